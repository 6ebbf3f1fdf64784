"""Fused merge kernels (numba): one pass over an expert's stored values per operator step, no temporaries.

Each kernel does, per element, exactly the float32 operations of docs/SEMANTICS.md in the same order as the
torch formulas (``x * w`` with ``w`` the float32 of the Python float, sums into +0.0-started accumulators),
so results are identical bit for bit; numba compiles without fast-math, so nothing is reassociated or
contracted into FMAs. Expert values come straight from the stored bytes — ``raw`` is the tensor's BF16 bit
patterns (uint16) or its float32 values, flat — and only the selected element ranges are touched
(``ranges``: sorted, disjoint ``[start, stop)`` rows of an int64 array); elsewhere the expert equals the base
(Δ = 0) and its bytes were never read. Loops run over zero-based slices so LLVM vectorizes them. All
kernels release the GIL.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from mergepipe_db.kernels import exact_sum
from mergepipe_db.kernels import torch_rand as mt19937
from mergepipe_db.kernels.float_bits import f32_to_bits, widen

HIST_BINS = 1 << 15  # top 16 bits of a non-negative float32 (NaN included: 0x7FFF.... >> 16 < 2**15)
_INF_PREFIX = 0x7F80  # top 16 bits of +inf; every NaN is at or above it


def pack(arrays: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Flat arrays of one dtype as the `raws` tuple of the fused kernels, padded with empty arrays to a power
    of two: the kernels are compiled (and cached on disk) once per dtype and padded length. A numba typed
    List would need no padding, but building one compiles its methods in every process (~0.5 s per item
    type here). The kernels index only the first ``selected.shape[0]`` entries."""
    n = 1 << max(len(arrays) - 1, 0).bit_length()
    pad = np.empty(0, arrays[0].dtype)
    return tuple(np.ascontiguousarray(a).reshape(-1) for a in arrays) + (pad,) * (n - len(arrays))


def kept_masks(masks: list[np.ndarray | None]) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The kept masks of a fused pass's inputs (None: no mask; bool: a byte an element; uint8: packed eight to
    a byte, `pack_bits`) as `masked_fused` and `dare_ties_fused` take them: their bytes (`pack`) and each one's
    kind (0, 1 or 2 in that order)."""
    none = np.empty(0, np.uint8)
    kinds = np.array([0 if m is None else 2 if m.dtype == np.uint8 else 1 for m in masks], np.int64)
    return pack([none if m is None else m.view(np.uint8) for m in masks]), kinds


@numba.njit(cache=True, nogil=True)
def _linear_span(acc: np.ndarray, src: np.ndarray, w: np.float32, first: bool) -> None:
    zero = np.float32(0.0)
    if first:
        for i in range(acc.shape[0]):
            acc[i] = zero + widen(src[i]) * w
    else:
        for i in range(acc.shape[0]):
            acc[i] = acc[i] + widen(src[i]) * w


@numba.njit(cache=True, nogil=True)
def widen_into(out: np.ndarray, raw: np.ndarray) -> None:
    """out = the stored values `raw` as float32 (BF16 bits widened exactly), flat arrays of one length."""
    for i in range(raw.shape[0]):
        out[i] = widen(raw[i])


@numba.njit(cache=True, nogil=True)
def narrow_bf16(out: np.ndarray, x: np.ndarray) -> bool:
    """out = the BF16 bits (uint16) of float32 `x`, rounded to nearest, ties to even, as torch rounds. False
    when `x` holds a NaN: torch writes a NaN's BF16 bits differently in its vector and scalar loops, so the
    caller converts such a tensor with torch itself."""
    finite_or_inf = True
    for i in range(x.shape[0]):
        u = f32_to_bits(x[i])
        out[i] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        finite_or_inf &= x[i] == x[i]
    return finite_or_inf


@numba.njit(cache=True, nogil=True)
def narrow_bf16_with_table(out: np.ndarray, x: np.ndarray, base: np.ndarray, bounds: np.ndarray, skip: np.ndarray,
                           table: np.ndarray, lut: np.ndarray, exceptions: np.ndarray, unchanged: np.ndarray) -> bool:
    """`narrow_bf16` of `x` on the blocks not skipped; on a block with ``skip[b]``, out = lut[base] (`base`: θ₀'s
    BF16 bits; `table`: the operator's float32 result there as a function of them; `lut`: its BF16 bits).
    False when a NaN is met in either (the caller converts with torch).

    A non-empty `exceptions` (rows [bits, lut[bits]], as `near_identity` gives them) says that `lut` maps
    every other pattern to itself and `table` is NaN exactly on the NaN patterns: a skipped block is then
    scanned for those patterns (and NaN, from θ₀'s bits) without table lookups; one holding none of them is
    θ₀'s bytes and is not written: ``unchanged[b]`` says so, and the caller takes its bytes from `base`. The
    others are copied with the patterns replaced. `unchanged` is False for every other block."""
    ok = True
    fast = exceptions.shape[0] > 0
    for b in range(skip.shape[0]):
        s0, e0 = bounds[b], bounds[b + 1]
        unchanged[b] = False
        if skip[b] and fast:
            no_nan, moved = _scan_except(base[s0:e0], exceptions)
            ok &= no_nan
            if moved:
                _copy_except(out[s0:e0], base[s0:e0], exceptions)
            else:
                unchanged[b] = True
        elif skip[b]:
            for i in range(s0, e0):
                v = base[i]
                out[i] = lut[v]
                ok &= table[v] == table[v]
        elif not narrow_bf16(out[s0:e0], x[s0:e0]):
            ok = False
    return ok


@numba.njit(cache=True, nogil=True)
def _scan_except(base: np.ndarray, exceptions: np.ndarray) -> tuple[bool, bool]:
    """(no NaN in `base` (BF16 bits: exponent all ones, mantissa non-zero), some element of `base` that an
    exceptions row maps to other bits), in one read of `base` for the first row."""
    nan = np.uint16(0)
    moved = 0
    for r in range(exceptions.shape[0]):
        v, o = exceptions[r, 0], exceptions[r, 1]
        hits = 0
        if r == 0:
            for i in range(base.shape[0]):
                u = base[i]
                nan |= np.uint16((u & np.uint16(0x7FFF)) > np.uint16(0x7F80))
                hits += u == v
        elif v != o:
            for i in range(base.shape[0]):
                hits += base[i] == v
        if v != o:
            moved += hits
    return nan == 0, moved > 0


@numba.njit(cache=True, nogil=True)
def _copy_except(out: np.ndarray, base: np.ndarray, exceptions: np.ndarray) -> None:
    """out = base with each exceptions[r, 0] replaced by exceptions[r, 1] (BF16 bits)."""
    for r in range(exceptions.shape[0]):
        v, o = exceptions[r, 0], exceptions[r, 1]
        if r == 0:
            for i in range(base.shape[0]):
                u = base[i]
                out[i] = o if u == v else u
        else:
            for i in range(out.shape[0]):
                if base[i] == v:
                    out[i] = o


def near_identity(table: np.ndarray, lut: np.ndarray, max_exceptions: int = 4) -> np.ndarray:
    """Rows [bits, lut[bits]] (uint16, at least one) of the BF16 patterns that `lut` does not map to
    themselves, when `table` is NaN exactly on the NaN patterns and there are at most `max_exceptions` of
    them (e.g. −0 → +0 for θ₀·w sums); an empty array otherwise (`narrow_bf16_with_table`)."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    nan_bits = (bits & 0x7FFF) > 0x7F80
    if not np.array_equal(np.isnan(table), nan_bits):
        return np.empty((0, 2), np.uint16)
    moved = np.flatnonzero((lut.astype(np.uint32) != bits) & ~nan_bits)
    if moved.size > max_exceptions:
        return np.empty((0, 2), np.uint16)
    if moved.size == 0:  # the identity: one row that never matches a number (a NaN pattern, which fails anyway)
        return np.array([[0x7FC1, 0x7FC1]], np.uint16)
    return np.stack([moved, lut[moved]], axis=1).astype(np.uint16)


_TILE = 2048  # elements per tile of `_catch_up`: the accumulator tile stays in L1 across the experts
#: elements per tile of the kernels that draw DARE's uniforms: three MT19937 twists, tempered straight into the
#: tile (`torch_rand.stream_fill_words`); at most `exact_sum.TILE`, and `_TILE`
_MT_TILE = 3 * mt19937.STATE_WORDS


_BYTE_LANES = np.uint64(0x0101010101010101)  # 1 in each byte of a word
_PACK_MUL = np.uint64(0x0102040810204080)  # (eight 0/1 bytes · this) >> 56: byte q of the word in bit q
_LANE_BITS = np.uint64(0x8040201008040201)  # bit q of byte q
_LANE_CARRY = np.uint64(0x7F7F7F7F7F7F7F7F)  # + this: a byte's bit 7 set where the byte was not 0


@numba.njit(nogil=True, inline="always")
def pack_bits(bits: np.ndarray, o: int, words: np.ndarray, m: int) -> None:
    """The m flags of `words` (uint64 words whose bytes are 0 or 1: a bool tile seen as words) into bits[o:]
    (uint8), eight to a byte, flag i in bit i % 8 of byte o + i // 8 (a last partial byte's high bits 0). A
    block's mask is packed from its own byte offset (`mask_block_offset`), so blocks on different threads
    never share a byte."""
    for j in range(m // 8):
        bits[o + j] = np.uint8((words[j] * _PACK_MUL) >> np.uint64(56))
    if m % 8:  # the last, partial byte: only its first m % 8 flags
        w = words[m // 8] & ((np.uint64(1) << np.uint64(8 * (m % 8))) - np.uint64(1))
        bits[o + m // 8] = np.uint8((w * _PACK_MUL) >> np.uint64(56))


@numba.njit(nogil=True, inline="always")
def unpack_bits(words: np.ndarray, bits: np.ndarray, o: int, m: int) -> None:
    """`pack_bits` undone: the m flags from bits[o:] into the bytes of `words` (0 or 1 each)."""
    for j in range((m + 7) // 8):
        w = (np.uint64(bits[o + j]) * _BYTE_LANES) & _LANE_BITS
        words[j] = ((w + _LANE_CARRY) >> np.uint64(7)) & _BYTE_LANES


@numba.njit(cache=True, nogil=True)
def unpack_mask(keep: np.ndarray, bits: np.ndarray, bounds: np.ndarray, blocks: np.ndarray) -> None:
    """keep (bool, indexed by element) on the listed blocks from their packed mask (`pack_bits`, block b's from
    `mask_block_offset`)."""
    for b in blocks:
        o = mask_block_offset(bounds[b], b)
        for i in range(bounds[b + 1] - bounds[b]):
            keep[bounds[b] + i] = (bits[o + i // 8] >> np.uint8(i % 8)) & np.uint8(1)


def mask_bytes(numel: int, n_blocks: int) -> int:
    """The bytes of a packed mask (`pack_bits`) over a tensor of `numel` elements in `n_blocks` blocks: its
    flags, and a spare byte a block (`mask_block_offset`)."""
    return numel // 8 + n_blocks + 1


@numba.njit(nogil=True, inline="always")
def mask_block_offset(start: int, b: int) -> int:
    """Block b's first byte in a packed mask, `start` its first element: start // 8 + b (a spare byte a block:
    a block that ends inside a byte leaves it to itself). From Python, ``mask_block_offset.py_func`` takes
    arrays of starts and blocks."""
    return start // 8 + b


@numba.njit(nogil=True, inline="always")
def kept_tile(words: np.ndarray, keep: np.ndarray, kind: int, bounds: np.ndarray, b: int, t0: int,
              m: int) -> np.ndarray:
    """A kept mask's flags for the m elements from t0 (inside block b, t0 - bounds[b] a multiple of 8), a byte
    each: unpacked into `words` where the mask is packed (``kind`` 2, `pack_bits`), else a slice of it (1)."""
    if kind == 2:
        unpack_bits(words, keep, mask_block_offset(bounds[b], b) + (t0 - bounds[b]) // 8, m)
        return words.view(np.uint8)[:m]
    return keep[t0:t0 + m]


@numba.njit(cache=True, nogil=True)
def _catch_up(acc: np.ndarray, base: np.ndarray, weights: np.ndarray, first: bool) -> None:
    """acc = acc + θ₀ * w for each w of `weights` in order (``first``: acc starts at +0.0), tile by tile, so
    the accumulator is read and written once however many experts are folded."""
    zero = np.float32(0.0)
    n = acc.shape[0]
    for t0 in range(0, n, _TILE):
        a = acc[t0:min(n, t0 + _TILE)]
        b = base[t0:min(n, t0 + _TILE)]
        for j in range(weights.shape[0]):
            w = weights[j]
            if first and j == 0:
                for i in range(a.shape[0]):
                    a[i] = zero + b[i] * w
            else:
                for i in range(a.shape[0]):
                    a[i] = a[i] + b[i] * w


@numba.njit(cache=True, nogil=True)
def linear_fold(acc: np.ndarray, base: np.ndarray, raw: np.ndarray, bounds: np.ndarray, selected: np.ndarray,
                pending: np.ndarray, weights: np.ndarray, k: int) -> None:
    """Linear step for expert k on its selected blocks: acc = acc + θ_k * w_k in spec order.

    Block b spans elements [bounds[b], bounds[b+1]); pending[b] is the first expert not yet folded into it.
    Experts that skipped a block contribute θ₀ * w_j there; they are folded in only when the block is next
    touched (or by `linear_fused`), in order, so each element costs one pass however many experts omit it.
    """
    for b in range(selected.shape[0]):
        if not selected[b]:
            continue
        s0, e0 = bounds[b], bounds[b + 1]
        j = pending[b]
        if j < k:
            _catch_up(acc[s0:e0], base[s0:e0], weights[j:k], j == 0)
        _linear_span(acc[s0:e0], raw[s0:e0], weights[k], j == 0 and k == 0)
        pending[b] = k + 1


@numba.njit(cache=True, nogil=True)
def linear_fused(acc: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], slot: np.ndarray,
                 selected: np.ndarray, bounds: np.ndarray, weights: np.ndarray, pending: np.ndarray, j1: int,
                 skip: np.ndarray, divisor: np.float32, divide: bool) -> None:
    """Linear steps for experts pending[b]..j1-1 on each block b in one tiled pass, when the stored values
    of those with a slot are at hand: expert j is ``raws[slot[j]]`` on the blocks b with
    ``selected[slot[j], b]`` and θ₀ elsewhere (and everywhere when ``slot[j] < 0``); with ``divide`` (the
    last pass of a normalized merge), then acc = acc / divisor. Tile by tile the accumulator stays in L1
    while the experts are folded in order (expert 0 starts it at +0.0): the same operations as
    `linear_fold`, catching up and the normalizing division, the same bits, with one pass over the
    accumulator instead of one per expert. Blocks with ``skip[b]`` (no expert selected them; the caller
    writes them from θ₀ alone) are left as they are; the others end with pending[b] = j1."""
    for b in range(bounds.shape[0] - 1):
        if skip[b]:
            continue
        j0 = pending[b]
        for t0 in range(bounds[b], bounds[b + 1], _TILE):
            m = min(_TILE, bounds[b + 1] - t0)
            a = acc[t0:t0 + m]
            for j in range(j0, j1):
                s = slot[j]
                if s >= 0 and selected[s, b]:
                    _linear_span(a, raws[s][t0:t0 + m], weights[j], j == 0)
                else:
                    _linear_span(a, base[t0:t0 + m], weights[j], j == 0)
            if divide:
                for i in range(m):
                    a[i] = a[i] / divisor
        pending[b] = j1


@numba.njit(cache=True, nogil=True)
def delta_fused(mixed: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                bounds: np.ndarray, w: np.ndarray, trim: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                skip: np.ndarray, start: bool, finish: bool, normalize: bool, divisor: np.float32,
                lam: np.float32) -> None:
    """`delta_add` for every expert k of ``raws`` in order (on the blocks with ``selected[k, b]``), tile by
    tile, so the sum and the base stay in L1: the same bits as one `delta_add` per expert; an expert with
    ``trim[k]`` adds where(lo[k] <= |Δ| <= hi[k], Δ, 0.0)·w (breadcrumbs' band lo < |Δ| < hi as its float32
    neighbours inward: the bits of `masked_delta` added into the sum). Blocks with
    ``skip[b]`` are left as they are. With ``start`` the sum starts at +0.0 (``mixed`` holds nothing yet);
    with ``finish`` (the last pass) each element then ends as the additive operators' `_finish` makes it:
    θ₀ + (mixed / divisor, where ``normalize``) · λ, in that order. One pass instead of a zeroing pass before
    and three after."""
    K = selected.shape[0]
    _additive_fused_blocks(mixed, base, raws, selected, bounds, w, trim, lo, hi, (np.empty(0, np.uint8),),
                           np.zeros(K, np.int64), np.ones(K, np.float32), skip, start, finish, normalize, divisor,
                           lam, 0, bounds.shape[0] - 1)


@numba.njit(cache=True, nogil=True, parallel=True)
def masked_fused(mixed: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                 bounds: np.ndarray, w: np.ndarray, keeps: tuple[np.ndarray, ...], masked: np.ndarray,
                 scales: np.ndarray, skip: np.ndarray, start: bool, finish: bool, normalize: bool,
                 divisor: np.float32, lam: np.float32) -> None:
    """`delta_fused` for dare_linear and della_linear: every expert k of ``raws`` in order (on the blocks with
    ``selected[k, b]``) adds T·w, tile by tile, where T = where(keep_k, Δ · scales[k], 0.0) for an expert
    with ``masked[k]`` (its drawn mask keeps[k], uint8: ``masked[k]`` 1, a byte an element in the tensor's flat
    shape; 2, packed eight to a byte, `pack_bits`; ``scales[k]`` is 1 where the rescale leaves Δ as it is:
    Δ · 1 = Δ, bit for bit) and T = Δ for the others (density 1: no mask). The bits of
    `masked_delta_span` (mode 1 or 0) and `delta_add` folded one expert at a time, then `_finish`; ``start``,
    ``finish`` and ``skip`` as in `delta_fused`. The blocks in contiguous chunks on numba's threads."""
    K = selected.shape[0]
    no_trim, no_bound = np.zeros(K, np.bool_), np.zeros(K, np.float32)
    nb = bounds.shape[0] - 1
    c = max(1, min(_PAR_CHUNKS, nb))
    for t in numba.prange(c):
        _additive_fused_blocks(mixed, base, raws, selected, bounds, w, no_trim, no_bound, no_bound, keeps, masked,
                               scales, skip, start, finish, normalize, divisor, lam, nb * t // c, nb * (t + 1) // c)


@numba.njit(cache=True, nogil=True)
def _additive_fused_blocks(mixed: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                           bounds: np.ndarray, w: np.ndarray, trim: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                           keeps: tuple[np.ndarray, ...], masked: np.ndarray, scales: np.ndarray, skip: np.ndarray,
                           start: bool, finish: bool, normalize: bool, divisor: np.float32, lam: np.float32,
                           b0: int, b1: int) -> None:
    """`delta_fused` (breadcrumbs' bands: ``trim``) and `masked_fused` (kept masks: ``masked``) on blocks
    [b0, b1)."""
    zero = np.float32(0.0)
    words = np.empty(_TILE // 8 + 1, np.uint64)  # a packed mask's tile, a byte a flag (`kept_tile`)
    for b in range(b0, b1):
        if skip[b]:
            continue
        for t0 in range(bounds[b], bounds[b + 1], _TILE):  # a tile starts on a whole byte of a packed mask
            m = min(_TILE, bounds[b + 1] - t0)
            mm, bb = mixed[t0:t0 + m], base[t0:t0 + m]
            if start:
                for i in range(m):
                    mm[i] = zero
            for k in range(selected.shape[0]):
                if not selected[k, b]:
                    continue
                x, wk = raws[k][t0:t0 + m], w[k]
                if masked[k]:  # Δ · 1 = Δ, bit for bit: one loop whether or not the rescale scales
                    kk = kept_tile(words, keeps[k], masked[k], bounds, b, t0, m)
                    sk = scales[k]
                    for i in range(m):
                        q = (widen(x[i]) - bb[i]) * sk
                        mm[i] = mm[i] + (q if kk[i] else zero) * wk
                elif trim[k]:
                    lk, hk = lo[k], hi[k]
                    for i in range(m):
                        d = widen(x[i]) - bb[i]
                        a = abs(d)
                        mm[i] = mm[i] + (d if (a >= lk) & (a <= hk) else zero) * wk
                else:
                    for i in range(m):
                        mm[i] = mm[i] + (widen(x[i]) - bb[i]) * wk
            if finish:
                for i in range(m):
                    v = mm[i] / divisor if normalize else mm[i]
                    mm[i] = v * lam + bb[i]


@numba.njit(cache=True, nogil=True)
def delta_add(mixed: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, w: np.float32) -> None:
    """mixed = mixed + (θ_k − θ₀) * w on `ranges` (task arithmetic; elsewhere Δ_k = 0 adds nothing)."""
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        m, b, x = mixed[s0:e0], base[s0:e0], raw[s0:e0]
        for i in range(m.shape[0]):
            m[i] = m[i] + (widen(x[i]) - b[i]) * w


@numba.njit(cache=True, nogil=True)
def absdelta(out: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray) -> None:
    """out[:n_read] = |θ_k − θ₀| of the elements on `ranges`, packed in order."""
    o = 0
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        y, b, x = out[o:o + e0 - s0], base[s0:e0], raw[s0:e0]
        for i in range(y.shape[0]):
            y[i] = abs(widen(x[i]) - b[i])
        o += e0 - s0


@numba.njit(cache=True, nogil=True)
def absdelta_hist(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, hist: np.ndarray) -> None:
    """hist[bits(|Δ|) >> 16] += 1 over the elements on `ranges` (non-negative float32 order = bit order)."""
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        b, x = base[s0:e0], raw[s0:e0]
        for i in range(b.shape[0]):
            hist[f32_to_bits(abs(widen(x[i]) - b[i])) >> np.uint32(16)] += 1


@numba.njit(cache=True, nogil=True)
def absdelta_collect(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, prefix: np.uint32,
                     out: np.ndarray) -> int:
    """Bit patterns of the |Δ| on `ranges` whose top 16 bits equal `prefix`, into `out`; returns how many."""
    o = 0
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        b, x = base[s0:e0], raw[s0:e0]
        for i in range(b.shape[0]):
            bits = f32_to_bits(abs(widen(x[i]) - b[i]))
            if (bits >> np.uint32(16)) == prefix:
                out[o] = bits
                o += 1
    return o


@numba.njit(cache=True, nogil=True)
def absdelta_bin(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, lo: np.float32, hi: np.float32,
                 out: np.ndarray) -> tuple[int, int, int]:
    """One pass over the |Δ| on `ranges`: the bit patterns of those in [lo, hi) into `out` (stops storing once
    it is full); returns (how many are in [lo, hi), how many are >= hi, how many are NaN)."""
    got = 0
    above = 0
    nan = 0
    cap = out.shape[0]
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        b, x = base[s0:e0], raw[s0:e0]
        for i in range(b.shape[0]):
            a = abs(widen(x[i]) - b[i])
            if a != a:
                nan += 1
            elif a >= hi:
                above += 1
            elif a >= lo:
                if got < cap:
                    out[got] = f32_to_bits(a)
                got += 1
    return got, above, nan


@numba.njit(cache=True, nogil=True)
def _absdelta_count_span(b: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    """(how many |Δ| of the span are finite and nonzero, how many are inf or NaN)."""
    nonzero = 0
    finite = 0
    zero = np.float32(0.0)
    inf = np.float32(np.inf)
    for i in range(b.shape[0]):  # branch-free, so it vectorizes
        a = abs(widen(x[i]) - b[i])
        finite += np.int64(a < inf)
        nonzero += np.int64(a < inf) & np.int64(a > zero)
    return nonzero, b.shape[0] - finite


@numba.njit(cache=True, nogil=True)
def absdelta_count(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray) -> tuple[int, int]:
    """(how many |Δ| on `ranges` are finite and nonzero, how many are inf or NaN)."""
    nonzero = 0
    special = 0
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        nz, sp = _absdelta_count_span(base[s0:e0], raw[s0:e0])
        nonzero += nz
        special += sp
    return nonzero, special


@numba.njit(cache=True, nogil=True)
def _ties_span(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, b: np.ndarray,
               x: np.ndarray, trim: bool, tau: np.float32, w: np.float32, weights: bool, init: bool,
               ) -> None:
    """One expert's TIES sums on a span: T = Δ, or where(|Δ| >= τ, Δ, 0.0) with ``trim``."""
    zero = np.float32(0.0)
    for i in range(S.shape[0]):
        d = widen(x[i]) - b[i]
        if trim:
            d = d if abs(d) >= tau else zero
        _ties_accumulate(S, P, N, WP, WN, i, d * w, w, weights, init)


@numba.njit(nogil=True)
def _ties_accumulate(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, i: int,
                     dw: np.float32, w: np.float32, weights: bool, init: bool) -> None:
    """Element i of the TIES sums gets the weighted term dw (``init``: fresh accumulators, +0.0 + term)."""
    zero = np.float32(0.0)
    S[i] = (zero if init else S[i]) + dw
    P[i] = (zero if init else P[i]) + (dw if dw > zero else zero)
    N[i] = (zero if init else N[i]) + (dw if dw < zero else zero)
    if weights:
        WP[i] = (zero if init else WP[i]) + (w if dw > zero else zero)
        WN[i] = (zero if init else WN[i]) + (w if dw < zero else zero)


@numba.njit(cache=True, nogil=True)
def ties_dare_span(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, b: np.ndarray,
                   x: np.ndarray, u: np.ndarray, dens: np.float32, w: np.float32, weights: bool, init: bool) -> None:
    """dare_ties: the TIES sums of one block's DARE task vector T = where(u < d, Δ / d, 0.0), tile by tile:
    T into an L1 tile, then `_ties_span` on it against zeros (T − 0 = T, bit for bit)."""
    zero = np.float32(0.0)
    t = np.empty(_TILE, np.float32)
    z = np.zeros(_TILE, np.float32)
    n = S.shape[0]
    for t0 in range(0, n, _TILE):
        m = min(_TILE, n - t0)
        xs, bs, us = x[t0:t0 + m], b[t0:t0 + m], u[t0:t0 + m]
        for i in range(m):
            q = (widen(xs[i]) - bs[i]) / dens
            t[i] = q if us[i] < dens else zero
        _ties_span(S[t0:t0 + m], P[t0:t0 + m], N[t0:t0 + m], WP[t0:t0 + m], WN[t0:t0 + m], z[:m], t[:m], False,
                   np.float32(np.inf), w, weights, init)


@numba.njit(cache=True, nogil=True)
def dare_delta_span(mixed: np.ndarray, b: np.ndarray, x: np.ndarray, u: np.ndarray, dens: np.float32,
                    w: np.float32) -> None:
    """mixed = mixed + where(u < d, Δ / d, 0.0) * w on one block (dare_linear)."""
    zero = np.float32(0.0)
    for i in range(mixed.shape[0]):
        t = (widen(x[i]) - b[i]) / dens
        mixed[i] = mixed[i] + (t if u[i] < dens else zero) * w


@numba.njit(cache=True, nogil=True)
def absdelta_top(a: np.ndarray, x: np.ndarray, b: np.ndarray) -> np.uint32:
    """a[:m] = |widen(x) − b| for the m = len(x) elements of a tile; returns their largest magnitude bit pattern
    (`exact_sum.add_split_top`'s ``top``)."""
    top = np.uint32(0)
    for i in range(x.shape[0]):
        v = abs(widen(x[i]) - b[i])
        a[i] = v
        top = max(top, f32_to_bits(v) & np.uint32(0x7FFFFFFF))
    return top


@numba.njit(cache=True, nogil=True)
def random_keep(keep: np.ndarray, b: np.ndarray, x: np.ndarray, u: np.ndarray, p: np.ndarray, p_step: int,
                l1: bool, acc_kept: np.ndarray, acc_dropped: np.ndarray) -> None:
    """A random drop's mask on one block: keep = u < p[i * p_step] (``p_step`` 0: one probability, DARE's
    float32 d; 1: DELLA's per element); with ``l1``, the exact sums (`exact_sum`) of the kept |Δ| into
    `acc_kept` and of the dropped ones into `acc_dropped` (‖Δ‖₁ is their total), a tile at a time."""
    n = keep.shape[0]
    if p_step == 0:
        p0 = p[0]
        for i in range(n):
            keep[i] = u[i] < p0
    else:
        for i in range(n):
            keep[i] = u[i] < p[i]
    if not l1:
        return
    T = exact_sum.TILE
    a = np.empty(T, np.float32)
    for t0 in range(0, n, T):
        m = min(T, n - t0)
        top = absdelta_top(a, x[t0:t0 + m], b[t0:t0 + m])
        exact_sum.add_split_top(acc_kept, acc_dropped, a[:m], keep[t0:t0 + m], top)


@numba.njit(inline="always", nogil=True)
def _masked(d: np.float32, k: bool, p: np.float32, mode: int, scale: np.float32) -> np.float32:
    """One element of a random drop's T: where(keep, Δ (mode 0) | Δ * s (1) | Δ / p (2), 0.0)."""
    if mode == 1:
        t = d * scale
    elif mode == 2:
        t = d / p
    else:
        t = d
    return t if k else np.float32(0.0)


@numba.njit(cache=True, nogil=True)
def masked_task_vector(out: np.ndarray, b: np.ndarray, x: np.ndarray, keep: np.ndarray, p: np.ndarray,
                       p_step: int, mode: int, scale: np.float32) -> None:
    """out = T of one block, `_masked` per element (p[i * p_step] its keep probability)."""
    for i in range(out.shape[0]):
        out[i] = _masked(widen(x[i]) - b[i], keep[i], p[i * p_step], mode, scale)


@numba.njit(cache=True, nogil=True)
def masked_delta_span(mixed: np.ndarray, b: np.ndarray, x: np.ndarray, keep: np.ndarray, p: np.ndarray,
                      p_step: int, mode: int, scale: np.float32, w: np.float32) -> None:
    """mixed = mixed + T * w on one block, T as `masked_task_vector` gives it (dare_linear, della_linear)."""
    for i in range(mixed.shape[0]):
        mixed[i] = mixed[i] + _masked(widen(x[i]) - b[i], keep[i], p[i * p_step], mode, scale) * w


@numba.njit(cache=True, nogil=True)
def ties_masked_span(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, b: np.ndarray,
                     x: np.ndarray, keep: np.ndarray, p: np.ndarray, p_step: int, mode: int, scale: np.float32,
                     w: np.float32, weights: bool, init: bool) -> None:
    """The TIES sums of one block's T (`masked_task_vector`), tile by tile as `ties_dare_span` (dare_ties, della)."""
    t = np.empty(_TILE, np.float32)
    z = np.zeros(_TILE, np.float32)
    n = S.shape[0]
    for t0 in range(0, n, _TILE):
        m = min(_TILE, n - t0)
        for i in range(m):
            j = t0 + i
            t[i] = _masked(widen(x[j]) - b[j], keep[j], p[j * p_step], mode, scale)
        _ties_span(S[t0:t0 + m], P[t0:t0 + m], N[t0:t0 + m], WP[t0:t0 + m], WN[t0:t0 + m], z[:m], t[:m], False,
                   np.float32(np.inf), w, weights, init)


@numba.njit(cache=True, nogil=True)
def ties_add(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, base: np.ndarray,
             raw: np.ndarray, bounds: np.ndarray, blocks: np.ndarray, touched: np.ndarray, trim: bool,
             tau: np.float32, w: np.float32, weights: bool) -> None:
    """TIES steps 1-2 and the streaming sums of steps 3-5 for one expert on its selected `blocks` (block b
    spans elements [bounds[b], bounds[b+1]); elsewhere D_k = 0 and nothing is touched):
    T = where(|Δ| >= τ, Δ, 0.0) (``trim``; else T = Δ), D = T * w, S += D, P += where(D > 0, D, 0),
    N += where(D < 0, D, 0) and, with ``weights`` (normalize), WP += where(D > 0, w, 0), WN likewise.
    A block not yet `touched` holds garbage: its sums start at +0.0 here (written, not cleared and added to)."""
    for j in range(blocks.shape[0]):
        b = blocks[j]
        s0, e0 = bounds[b], bounds[b + 1]
        # WP / WN are empty without ``weights``: their slices stay empty and are never indexed
        _ties_span(S[s0:e0], P[s0:e0], N[s0:e0], WP[s0:e0], WN[s0:e0], base[s0:e0], raw[s0:e0], trim, tau, w,
                   weights, not touched[b])
        touched[b] = True


@numba.njit(cache=True, nogil=True)
def ties_clear_untouched(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray,
                         bounds: np.ndarray, touched: np.ndarray, weights: bool) -> None:
    """Start every block not yet touched at +0.0 (before a torch-path fold, which adds), and mark it."""
    zero = np.float32(0.0)
    for b in range(touched.shape[0]):
        if not touched[b]:
            s0, e0 = bounds[b], bounds[b + 1]
            S[s0:e0] = zero
            P[s0:e0] = zero
            N[s0:e0] = zero
            if weights:
                WP[s0:e0] = zero
                WN[s0:e0] = zero
            touched[b] = True


@numba.njit(cache=True, nogil=True)
def _ties_finish_span(out: np.ndarray, P: np.ndarray, S: np.ndarray, N: np.ndarray, WP: np.ndarray,
                      WN: np.ndarray, base: np.ndarray, normalize: bool, lam: np.float32) -> None:
    """out = θ₀ + (mixed / div if normalize else mixed) * λ from the sums (`out` may be P)."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    if normalize:
        for i in range(out.shape[0]):
            pos = S[i] >= zero
            div = WP[i] if pos else WN[i]
            out[i] = base[i] + (P[i] if pos else N[i]) / (one if div == zero else div) * lam
    else:
        for i in range(out.shape[0]):
            out[i] = base[i] + (P[i] if S[i] >= zero else N[i]) * lam


@numba.njit(cache=True, nogil=True)
def _untouched_span(out: np.ndarray, base: np.ndarray, lam: np.float32) -> None:
    """Where no expert contributed every sum is 0, so the formula gives θ₀ + (+0.0 * λ)."""
    c = np.float32(0.0) * lam
    for i in range(out.shape[0]):
        out[i] = base[i] + c


@numba.njit(cache=True, nogil=True)
def ties_finish(P: np.ndarray, S: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, base: np.ndarray,
                bounds: np.ndarray, touched: np.ndarray, normalize: bool, lam: np.float32, skip: np.ndarray) -> None:
    """TIES steps 3-6 into P: mixed = where(S >= 0, P, N); div = where(S >= 0, WP, WN), 1 where 0;
    P = θ₀ + (mixed / div if normalize else mixed) * λ; blocks no expert touched skip the sums, and blocks
    with ``skip[b]`` (the caller writes them from θ₀ alone) are left as they are."""
    for b in range(touched.shape[0]):
        s0, e0 = bounds[b], bounds[b + 1]
        if skip[b]:
            continue
        if touched[b]:
            _ties_finish_span(P[s0:e0], P[s0:e0], S[s0:e0], N[s0:e0], WP[s0:e0], WN[s0:e0], base[s0:e0],
                              normalize, lam)
        else:
            _untouched_span(P[s0:e0], base[s0:e0], lam)


@numba.njit(cache=True, nogil=True)
def _ties_tile(acc: np.ndarray, b: np.ndarray, x: np.ndarray, trim: bool, tau: np.float32, hi: np.float32,
               w: np.float32, weights: bool, init: bool) -> None:
    """`_ties_span` on one tile whose sums S, P, N, WP, WN are the planar `_TILE`-element rows of the one
    array `acc`: the compiler sees constant distances between them instead of five arrays that might
    overlap, so it vectorizes the loop without runtime overlap checks. With `trim` an element is kept where
    tau <= |Δ| <= hi (TIES: hi = +inf; breadcrumbs' band lo < |Δ| < hi as the float32 neighbours inward)."""
    zero = np.float32(0.0)
    keep_all = not trim
    T = _TILE
    if weights:
        for i in range(b.shape[0]):
            d = widen(x[i]) - b[i]
            a = abs(d)
            d = d if keep_all | ((a >= tau) & (a <= hi)) else zero
            dw = d * w
            s, p, n, wp, wn = acc[i], acc[T + i], acc[2 * T + i], acc[3 * T + i], acc[4 * T + i]
            acc[i] = (zero if init else s) + dw
            acc[T + i] = (zero if init else p) + (dw if dw > zero else zero)
            acc[2 * T + i] = (zero if init else n) + (dw if dw < zero else zero)
            acc[3 * T + i] = (zero if init else wp) + (w if dw > zero else zero)
            acc[4 * T + i] = (zero if init else wn) + (w if dw < zero else zero)
    else:
        for i in range(b.shape[0]):
            d = widen(x[i]) - b[i]
            a = abs(d)
            d = d if keep_all | ((a >= tau) & (a <= hi)) else zero
            dw = d * w
            s, p, n = acc[i], acc[T + i], acc[2 * T + i]
            acc[i] = (zero if init else s) + dw
            acc[T + i] = (zero if init else p) + (dw if dw > zero else zero)
            acc[2 * T + i] = (zero if init else n) + (dw if dw < zero else zero)


@numba.njit(cache=True, nogil=True, parallel=True)
def ties_fused(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
               bounds: np.ndarray, trim: np.ndarray, tau: np.ndarray, hi: np.ndarray, w: np.ndarray, weights: bool,
               lam: np.float32, count: np.ndarray, counts: np.ndarray, skip: np.ndarray) -> None:
    """The whole TIES fold of one tensor in one pass, when every expert's stored values are at hand:
    tile by tile (`_TILE` elements), the sums of `ties_add` for experts k = 0..K-1 in order (those with
    ``selected[k, b]`` on block b; elsewhere D_k = 0 adds nothing) stay in L1, then `ties_finish`'s formula
    writes `out`; an expert with ``trim[k]`` keeps the elements with tau[k] <= |Δ| <= hi[k] (`_ties_tile`:
    TIES's τ with hi = +inf, or breadcrumbs_ties' band). Same operations, same order as the streaming kernels
    (for a band: as `masked_delta` and `ties_add_terms`): the same bits, without reading and
    writing five tensor-sized sums once per expert. For each k with ``count[k]``, `counts[k]` gets what
    `absdelta_count` would give on its selected blocks (from the tile just read, still in cache). Blocks with
    ``skip[b]`` (no expert selected them; the caller writes them) are left as they are. Runs on numba's
    threads, the blocks in contiguous chunks (each element's operations are the same; the counts are integer
    sums)."""
    nb = bounds.shape[0] - 1
    c = max(1, min(_PAR_CHUNKS, nb))
    parts = np.zeros((c, counts.shape[0], 2), np.int64)
    for t in numba.prange(c):
        _ties_fused_blocks(out, base, raws, selected, bounds, trim, tau, hi, w, weights, lam, count, parts[t], skip,
                           nb * t // c, nb * (t + 1) // c)
    for t in range(c):
        counts += parts[t]


@numba.njit(cache=True, nogil=True)
def _ties_fused_blocks(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                       bounds: np.ndarray, trim: np.ndarray, tau: np.ndarray, hi: np.ndarray, w: np.ndarray,
                       weights: bool, lam: np.float32, count: np.ndarray, counts: np.ndarray, skip: np.ndarray,
                       b0: int, b1: int) -> None:
    """`ties_fused` on blocks [b0, b1)."""
    T = _TILE
    acc = np.empty(5 * T, np.float32)  # the tile's S, P, N, WP, WN (`_ties_tile`)
    for b in range(b0, b1):
        if skip[b]:
            continue
        for t0 in range(bounds[b], bounds[b + 1], _TILE):
            m = min(_TILE, bounds[b + 1] - t0)
            bb = base[t0:t0 + m]
            fresh = True
            for k in range(selected.shape[0]):
                if not selected[k, b]:
                    continue
                xk = raws[k][t0:t0 + m]
                _ties_tile(acc, bb, xk, trim[k], tau[k], hi[k], w[k], weights, fresh)
                fresh = False
                if count[k]:
                    nonzero, special = _absdelta_count_span(bb, xk)
                    counts[k, 0] += nonzero
                    counts[k, 1] += special
            if fresh:
                _untouched_span(out[t0:t0 + m], bb, lam)
            else:
                _ties_finish_span(out[t0:t0 + m], acc[T:T + m], acc[:m], acc[2 * T:2 * T + m], acc[3 * T:3 * T + m],
                                  acc[4 * T:4 * T + m], bb, weights, lam)


@numba.njit(cache=True, nogil=True, parallel=True)
def dare_ties_fused(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                    bounds: np.ndarray, dens: np.ndarray, seeds: np.ndarray, w: np.ndarray, weights: bool,
                    lam: np.float32, skip: np.ndarray, modes: np.ndarray, scales: np.ndarray,
                    keeps: tuple[np.ndarray, ...], masked: np.ndarray) -> None:
    """The whole dare_ties fold of one tensor in one pass, as `ties_fused` does for ties: tile by tile, for
    experts k = 0..K-1 in order (those with ``selected[k, b]``), T = where(u < d_k, Δ_k / d_k, 0.0) with u
    drawn from the block's stream (`seeds[k, b]`; `mt19937`), or T = Δ_k where d_k >= 1 (no mask is drawn),
    then `ties_dare_span`'s sums, kept in L1, and `ties_finish`'s formula into `out`. Same operations, same
    order: the same bits as folding the experts one by one with `ties_dare_span`, without a block of uniforms
    and five tensor-sized sums per expert. ``modes[k]`` says how a kept Δ is rescaled (`_masked`): 2 (DARE's
    classic Δ / d_k, above), 1 (Δ * scales[k]: the L1 rescale, known beforehand) or 0 (Δ). An expert with
    ``masked[k]`` takes its mask from keeps[k] (uint8) instead of drawing one, Δ times scales[k] (1 in mode 0:
    Δ · 1 = Δ, bit for bit), the mask a byte an
    element (``masked[k]`` 1, the tensor's flat shape: the bits of `ties_masked_span`) or packed eight to a
    byte (``masked[k]`` 2, as `dare_keep_blocks` and `row_ranks.della_keep_blocks` pack them: the same mask as
    drawn). Runs on numba's threads, the blocks in contiguous chunks (each block's streams start at its own
    seed, so no block depends on another)."""
    nb = bounds.shape[0] - 1
    c = max(1, min(_PAR_CHUNKS, nb))
    for t in numba.prange(c):
        _dare_ties_fused_blocks(out, base, raws, selected, bounds, dens, seeds, w, weights, lam, skip, modes, scales,
                                keeps, masked, nb * t // c, nb * (t + 1) // c)


@numba.njit(cache=True, nogil=True)
def _dare_ties_fused_blocks(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], selected: np.ndarray,
                            bounds: np.ndarray, dens: np.ndarray, seeds: np.ndarray, w: np.ndarray, weights: bool,
                            lam: np.float32, skip: np.ndarray, modes: np.ndarray, scales: np.ndarray,
                            keeps: tuple[np.ndarray, ...], masked: np.ndarray, b0: int, b1: int) -> None:
    """`dare_ties_fused` on blocks [b0, b1)."""
    T = _TILE  # the sums' rows in `acc` (`_ties_tile`); a tile takes whole twists of uniforms (`_MT_TILE`)
    K = selected.shape[0]
    zero = np.float32(0.0)
    inf = np.float32(np.inf)
    acc = np.empty(5 * T, np.float32)
    t = np.empty(T, np.float32)
    u = np.empty(T, np.float32)
    z = np.zeros(T, np.float32)
    words = np.empty(_MT_TILE // 8 + 1, np.uint64)  # a packed mask's tile, a byte a flag (`kept_tile`)
    states = np.empty((K, mt19937.STATE_WORDS), np.uint32)
    for b in range(b0, b1):
        if skip[b]:
            continue
        for k in range(K):
            if selected[k, b] and dens[k] < np.float32(1.0) and masked[k] == 0:
                mt19937.stream_start(states[k], seeds[k, b])
        for t0 in range(bounds[b], bounds[b + 1], _MT_TILE):
            m = min(_MT_TILE, bounds[b + 1] - t0)
            bb = base[t0:t0 + m]
            fresh = True
            for k in range(K):
                if not selected[k, b]:
                    continue
                xk = raws[k][t0:t0 + m]
                d = dens[k]
                if masked[k]:  # a kept mask: T = where(keep, Δ · s, 0.0); Δ · 1 = Δ, bit for bit (mode 0)
                    kk = kept_tile(words, keeps[k], masked[k], bounds, b, t0, m)
                    sk = scales[k]
                    for i in range(m):
                        q = (widen(xk[i]) - bb[i]) * sk
                        t[i] = q if kk[i] else zero
                    _ties_tile(acc, z[:m], t[:m], False, inf, inf, w[k], weights, fresh)
                elif d < np.float32(1.0):
                    mt19937.stream_fill_words(u[:m], states[k])
                    if modes[k] == 2:
                        for i in range(m):
                            q = (widen(xk[i]) - bb[i]) / d
                            t[i] = q if u[i] < d else zero
                    elif modes[k] == 1:
                        sk = scales[k]
                        for i in range(m):
                            q = (widen(xk[i]) - bb[i]) * sk
                            t[i] = q if u[i] < d else zero
                    else:
                        for i in range(m):
                            q = widen(xk[i]) - bb[i]
                            t[i] = q if u[i] < d else zero
                    _ties_tile(acc, z[:m], t[:m], False, inf, inf, w[k], weights, fresh)
                else:  # no mask drawn: T = Δ (`ties_add`)
                    _ties_tile(acc, bb, xk, False, inf, inf, w[k], weights, fresh)
                fresh = False
            if fresh:
                _untouched_span(out[t0:t0 + m], bb, lam)
            else:
                _ties_finish_span(out[t0:t0 + m], acc[T:T + m], acc[:m], acc[2 * T:2 * T + m], acc[3 * T:3 * T + m],
                                  acc[4 * T:4 * T + m], bb, weights, lam)


def _rth_largest(bits: np.ndarray, r: int) -> float:
    """The r-th largest (1-based) of non-negative float32 values given by their bit patterns."""
    j = bits.shape[0] - r  # == its j-th smallest
    return float(np.array([np.partition(bits, j)[j]], np.uint32).view(np.float32)[0])


def kth_largest_abs_delta(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, n_read: int, n_total: int,
                          k: int) -> float | None:
    """The k-th largest |Δ| (1 <= k <= n_total) of a tensor whose unread elements are 0: equal to
    ``torch.topk(|Δ|.flatten(), k).values.min()`` when every |Δ| read is finite; None when some is inf or NaN
    (the caller then takes its literal path). Radix select: a histogram of the top 16 bits finds the k-th
    largest's bucket, then only the elements in that bucket are collected and partitioned."""
    hist = np.zeros(HIST_BINS, np.int64)
    absdelta_hist(base, raw, ranges, hist)
    if hist[_INF_PREFIX:].any():
        return None
    hist[0] += n_total - n_read  # unread elements are zeros
    from_top = np.cumsum(hist[::-1])
    i = int(np.searchsorted(from_top, k, side="left"))
    prefix = HIST_BINS - 1 - i
    above = int(from_top[i]) - int(hist[prefix])
    r = k - above  # rank inside the prefix bucket, 1-based from the top
    out = np.empty(max(int(hist[prefix]), 1), np.uint32)
    got = absdelta_collect(base, raw, ranges, np.uint32(prefix), out)
    if r > got:  # only in bucket 0: the k-th largest is one of the unread zeros (the smallest values)
        return 0.0
    return _rth_largest(out[:got], r)


def kth_largest_in_bin(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, k: int, lo: float, hi: float,
                       in_bin: int, above: int) -> float | None:
    """The k-th largest |Δ| when the catalog's sketch says it lies in [lo, hi), a bin holding `in_bin` values
    with `above` values at or above `hi` (the unread elements all below `lo`): one pass collects that bin
    only. None when the rows read disagree with the sketch (the caller then takes the radix select)."""
    out = np.empty(max(in_bin, 1), np.uint32)
    got, n_above, _nan = absdelta_bin(base, raw, ranges, np.float32(lo), np.float32(hi), out)
    if got != in_bin or n_above != above or not 0 < k - above <= got:
        return None
    return _rth_largest(out[:got], k - above)


def sketch_tau(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, hist: np.ndarray, k: int, lo: float,
               hi: float) -> float:
    """TIES τ of a partly read tensor (docs/SEMANTICS.md), when its sketch `hist` is complete and holds no
    inf/NaN and puts the k-th largest |Δ| in bin [lo, hi) (not bin 0): NaN if a NaN is read; the exact value
    when every element of that bin was read (its rank inside the bin is known); else the sketch's
    interpolation. One pass over the rows read (`absdelta_bin`)."""
    from mergepipe_db.core import sketch

    b, above = sketch.locate_kth_largest(hist, k)
    out = np.empty(max(int(hist[b]), 1), np.uint32)
    got, _n_above, nan = absdelta_bin(base, raw, ranges, np.float32(lo), np.float32(hi), out)
    if nan:
        return float("nan")
    if got == int(hist[b]):
        return _rth_largest(out[:got], k - above)
    return float(np.float32(sketch.kth_largest(hist, k)))


def kth_largest_is_zero(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, k: int) -> bool | None:
    """Whether the k-th largest |Δ| of a tensor whose unread elements are 0 is 0 (fewer than k nonzero
    values); None when some |Δ| read is inf or NaN."""
    nonzero, special = absdelta_count(base, raw, ranges)
    return None if special else nonzero < k


# -- order statistics of |Δ| (`operators/order_stats.py`) and the breadcrumbs trim (`operators/fold.py`) -----

RADIX_BINS = 1 << 16  # bins of each radix pass: the top 16 bits of a float32's pattern, then the low 16


_RADIX_ROWS = 4  # interleaved counter rows: runs of equal values (zeros, ties) do not wait on one counter
_RADIX_SPAN = 1 << 28  # elements per flush of the int32 rows into the int64 histogram (no count overflows)
_RADIX_ROWS_MIN = 1 << 18  # below this many elements one row: clearing and summing the rows would dominate


@numba.njit(cache=True, nogil=True)
def _radix_count_one(hist: np.ndarray, v: np.uint32, low: bool, p0: np.uint32, p1: np.uint32, last: int) -> None:
    """Count one bit pattern: its top 16 bits (``low`` false), or its low 16 bits in the row of its prefix."""
    top = v >> np.uint32(16)
    if not low:
        hist[0, top] += 1
    elif top == p0:
        hist[0, v & np.uint32(0xFFFF)] += 1
    elif top == p1:
        hist[last, v & np.uint32(0xFFFF)] += 1


@numba.njit(cache=True, nogil=True)
def _radix_count(bits: np.ndarray, prefixes: np.ndarray, low: bool, hist: np.ndarray) -> None:
    """hist[0, bits[i] >> 16] += 1 (not ``low``), or hist[m, bits[i] & 0xFFFF] += 1 over the patterns whose
    top 16 bits equal prefixes[m] (``low``; one or two distinct prefixes). Branch-free: a pattern outside
    the prefixes counts in a spare bin (one per row and lane, so no two neighbours wait on one counter),
    which is dropped."""
    n = bits.shape[0]
    lowmask = np.uint32(0xFFFF)
    sixteen = np.uint32(16)
    m = prefixes.shape[0] if low else 1
    p0 = prefixes[0]
    p1 = prefixes[m - 1]
    spare = np.uint32(m * RADIX_BINS)
    if n < _RADIX_ROWS_MIN:
        for i in range(n):
            _radix_count_one(hist, bits[i], low, p0, p1, m - 1)
        return
    R = _RADIX_ROWS
    rows = np.zeros((R, m * RADIX_BINS + 8), np.int32)
    off1 = np.uint32((m - 1) * RADIX_BINS)
    for s0 in range(0, n, _RADIX_SPAN):
        e0 = min(n, s0 + _RADIX_SPAN)
        q = s0 + (e0 - s0) // R * R
        for i in range(s0, q, R):
            lane = np.uint32(i & 7)
            for r in range(R):
                v = bits[i + r]
                if low:
                    top = v >> sixteen
                    j = (v & lowmask) if top == p0 else (off1 + (v & lowmask) if top == p1 else spare + lane)
                else:
                    j = v >> sixteen
                rows[r, j] += 1
        for i in range(q, e0):
            _radix_count_one(hist, bits[i], low, p0, p1, m - 1)
        for r in range(R):
            for c in range(m):
                for j in range(RADIX_BINS):
                    hist[c, j] += rows[r, c * RADIX_BINS + j]
            rows[r, :] = 0


@numba.njit(cache=True, nogil=True)
def radix_count_high(bits: np.ndarray, hist: np.ndarray) -> None:
    """hist[bits[i] >> 16] += 1 (`bits`: float32 patterns as uint32; `hist`: `RADIX_BINS` int64 counters,
    added to)."""
    _radix_count(bits, np.zeros(1, np.uint32), False, hist.reshape(1, RADIX_BINS))


@numba.njit(cache=True, nogil=True)
def radix_count_low(bits: np.ndarray, prefixes: np.ndarray, hist: np.ndarray) -> None:
    """hist[m, bits[i] & 0xFFFF] += 1 over the patterns whose top 16 bits equal prefixes[m] (uint32, one or
    two distinct prefixes; `hist`: (len(prefixes), `RADIX_BINS`) int64 counters, added to), in one pass."""
    _radix_count(bits, prefixes, True, hist)


@numba.njit(cache=True, nogil=True)
def locate_from_top(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(index, count above it) of the k-th largest item (1 <= k <= hist.sum()) of a histogram over increasing
    keys; (-1, total) when k exceeds the total."""
    above = 0
    for i in range(hist.shape[0] - 1, -1, -1):
        c = hist[i]
        if above + c >= k:
            return i, above
        above += c
    return -1, above


@numba.njit(cache=True, nogil=True)
def count_ge(a: np.ndarray, v: np.float32) -> int:
    """How many of `a` are >= v (NaN never is)."""
    total = 0
    for i in range(a.shape[0]):
        total += np.int64(a[i] >= v)
    return total


@numba.njit(cache=True, nogil=True)
def count_nan(a: np.ndarray) -> int:
    """How many of `a` are NaN."""
    total = 0
    for i in range(a.shape[0]):
        total += np.int64(a[i] != a[i])
    return total


@numba.njit(cache=True, nogil=True)
def masked_delta(out: np.ndarray, base: np.ndarray, raw: np.ndarray, lo: np.float32, hi: np.float32,
                 test_lo: bool, band: bool, w: np.float32) -> bool:
    """out = where(keep, Δ, 0.0) * w for Δ = θ_k − θ₀ on one span (`raw`: θ_k's stored values), with, for
    a = |Δ|, keep = a >= lo (not ``band``: TIES) or lo < a < hi (``band``: breadcrumbs; without ``test_lo``
    no lower test). The literal formula of `DeltaFold._fold_masked`, in one pass; returns whether every
    element of `out` is finite."""
    zero = np.float32(0.0)
    inf = np.float32(np.inf)
    finite = True
    for i in range(out.shape[0]):
        d = widen(raw[i]) - base[i]
        a = abs(d)
        if band:
            keep = (a < hi) & ((not test_lo) | (a > lo))
        else:
            keep = a >= lo
        t = (d if keep else zero) * w
        out[i] = t
        finite &= abs(t) < inf
    return finite


# -- sce (`operators/sce.py`): the top-k mask by a threshold, the weights' squares, the election and the sum -----


#: elements per tile of the kernels that form Δ_k from the stored values (`delta_tile`), and of their read maps
RAW_TILE = 1024
_SCE_TILE = RAW_TILE  # columns per tile of the sce kernels: each expert's loop over a tile vectorizes


@numba.njit(cache=True, nogil=True)
def delta_tile(tile: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray, n_experts: int,
               s: int, m: int) -> None:
    """tile[k, :m] = Δ_k of elements s..s+m (s a multiple of `RAW_TILE`), as a gathered float32 copy holds it:
    widen(raws[k][s + i]) − base[s + i] where expert k read that tile (``read[k, s // RAW_TILE]``: its stored
    values valid on the whole tile), else +0.0 (its stored values there not read, not touched)."""
    b = base[s:s + m]
    j = s // RAW_TILE
    zero = np.float32(0.0)
    for k in range(n_experts):
        t = tile[k]
        if read[k, j]:
            x = raws[k][s:s + m]
            for i in range(m):
                t[i] = widen(x[i]) - b[i]
        else:
            t[:m] = zero


@numba.njit(cache=True, nogil=True)
def _sce_var_tile(o: np.ndarray, src: Any, off: int, m: int, n_experts: int, mean: np.ndarray,
                  m2: np.ndarray) -> int:
    """o[:m] = `sce_abs_var` of elements off..off+m of `src` (a tuple of flat Δ_k, or a (K, tile) array);
    returns how many are nonzero."""
    kf = np.float64(n_experts)
    zero = np.float32(0.0)
    mean[:m] = 0.0
    m2[:m] = 0.0
    for k in range(n_experts):
        x = src[k][off:off + m]
        nf = np.float64(k + 1)
        inv = 1.0 / nf
        by_inverse = k & (k + 1) == 0  # k + 1 a power of two: δ / n is δ times 1 / n exactly (one real, rounded once)
        for i in range(m):
            xi = np.float64(x[i])
            delta = xi - mean[i]
            mi = mean[i] + (delta * inv if by_inverse else delta / nf)
            mean[i] = mi
            m2[i] = m2[i] + delta * (xi - mi)
    nonzero = 0
    for i in range(m):
        v = abs(np.float32(m2[i] / kf))
        o[i] = v
        nonzero += np.int64(v != zero)
    return nonzero


@numba.njit(cache=True, nogil=True)
def _sce_abs_var_span(out: np.ndarray, ds: tuple[np.ndarray, ...], n_experts: int, s: int, e: int) -> int:
    """`sce_abs_var` on elements [s, e)."""
    nonzero = 0
    mean = np.empty(_SCE_TILE, np.float64)
    m2 = np.empty(_SCE_TILE, np.float64)
    for t0 in range(s, e, _SCE_TILE):
        m = min(_SCE_TILE, e - t0)
        nonzero += _sce_var_tile(out[t0:t0 + m], ds, t0, m, n_experts, mean, m2)
    return nonzero


@numba.njit(cache=True, nogil=True)
def _sce_abs_var_raw_span(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                          n_experts: int, s: int, e: int) -> int:
    """`sce_abs_var_raw` on elements [s, e)."""
    nonzero = 0
    mean = np.empty(_SCE_TILE, np.float64)
    m2 = np.empty(_SCE_TILE, np.float64)
    tile = np.empty((n_experts, _SCE_TILE), np.float32)
    for t0 in range(s, e, _SCE_TILE):
        m = min(_SCE_TILE, e - t0)
        delta_tile(tile, base, raws, read, n_experts, t0, m)
        nonzero += _sce_var_tile(out[t0:t0 + m], tile, 0, m, n_experts, mean, m2)
    return nonzero


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_abs_var_raw(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                    n_experts: int) -> int:
    """`sce_abs_var` with Δ_k formed a tile at a time from the stored values (flat) and their read map
    (`delta_tile`)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    counts = np.zeros(c, np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        counts[t] = _sce_abs_var_raw_span(out, base, raws, read, n_experts, s, e)
    return counts.sum()


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_abs_var(out: np.ndarray, ds: tuple[np.ndarray, ...], n_experts: int) -> int:
    """out = |torch.var(stack(ds[:n_experts]), dim=0, unbiased=False)| per element, bit for bit: torch's CPU
    Welford over the experts in order, in float64 (mean += δ/n, m2 += δ·(x − mean)), m2 / K rounded to
    float32. Returns how many are nonzero (NaN included), torch's count_nonzero. In chunks on numba's threads
    (each element's value is its own; the counts are integers)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    counts = np.zeros(c, np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        counts[t] = _sce_abs_var_span(out, ds, n_experts, s, e)
    return counts.sum()


@numba.njit(cache=True, nogil=True)
def sce_keep(bits: np.ndarray, t: np.uint32, k: int, keep: np.ndarray) -> bool:
    """keep[i] = 1 on the k largest of `bits` (non-negative float32 patterns as uint32, NaN largest), else 0,
    when they are every pattern at or above `t` (the k-th largest); False, `keep` untouched, when some patterns
    equal to `t` are in the k largest and some are not (which ones is then the caller's choice)."""
    n = bits.shape[0]
    at_least = 0
    for i in range(n):
        at_least += np.int64(bits[i] >= t)
    if at_least != k:
        return False
    for i in range(n):
        keep[i] = np.uint8(bits[i] >= t)
    return True


@numba.njit(cache=True, nogil=True)
def _sce_masked_square_span(out: np.ndarray, d: np.ndarray, keep: np.ndarray, masked: bool) -> None:
    if masked:
        for i in range(out.shape[0]):
            t = d[i] * np.float32(keep[i])
            out[i] = t * t
    else:
        for i in range(out.shape[0]):
            out[i] = d[i] * d[i]


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_masked_square(out: np.ndarray, d: np.ndarray, keep: np.ndarray, masked: bool) -> None:
    """out = (d * float32(keep))² (``masked``), or d² — torch's ``(tvs * mask).square()`` of one expert; in
    chunks on numba's threads."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _sce_masked_square_span(out[s:e], d[s:e], keep[s:e] if masked else keep[0:0], masked)


@numba.njit(cache=True, nogil=True)
def _sce_masked_square_raw_span(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                                keep: np.ndarray, masked: bool, s: int, e: int) -> None:
    """`sce_masked_square_raw` on elements [s, e): Δ a tile at a time (`delta_tile`), then `sce_masked_square`'s
    span on it."""
    tile = np.empty((1, RAW_TILE), np.float32)
    for t0 in range(s, e, RAW_TILE):
        m = min(RAW_TILE, e - t0)
        delta_tile(tile, base, raws, read, 1, t0, m)
        _sce_masked_square_span(out[t0:t0 + m], tile[0, :m], keep[t0:t0 + m] if masked else keep[0:0], masked)


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_masked_square_raw(out: np.ndarray, base: np.ndarray, raw: np.ndarray, read: np.ndarray, keep: np.ndarray,
                          masked: bool) -> None:
    """`sce_masked_square` of one expert's Δ formed from its stored values (flat) and its read map (`read`: a
    row of `delta_tile`'s)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    raws, rows = (raw,), read.reshape(1, -1)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _sce_masked_square_raw_span(out, base, raws, rows, keep, masked, s, e)


@numba.njit(cache=True, nogil=True)
def _sce_combine_tile(o: np.ndarray, b: np.ndarray, src: Any, off: int, m: int, n_experts: int, kp: np.ndarray,
                      masked: bool, w: np.ndarray, mk: np.ndarray, sg: np.ndarray, num: np.ndarray,
                      den: np.ndarray) -> None:
    """o[:m] = `sce_combine` of elements off..off+m of `src` (a tuple of flat Δ_k, or a (K, tile) array), θ₀
    there b, their keep flags kp; mk (all 1.0 unless ``masked``), sg, num, den: tile scratch."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    floor = np.float32(1e-6)
    if masked:
        for i in range(m):
            mk[i] = np.float32(kp[i])
    sg[:m] = zero
    for k in range(n_experts):
        x = src[k][off:off + m]
        if masked:
            for i in range(m):
                sg[i] += x[i] * mk[i]
        else:
            for i in range(m):
                sg[i] += x[i]
    for i in range(m):  # the majority sign, kept in sg
        sg[i] = one if sg[i] >= zero else -one
    num[:m] = zero
    den[:m] = zero
    for k in range(n_experts):
        x = src[k][off:off + m]
        wk = w[k]
        for i in range(m):
            tk = x[i] * mk[i] if masked else x[i]
            ek = wk * np.float32((np.float32(tk > zero) - np.float32(tk < zero)) == sg[i])
            num[i] += tk * ek
            den[i] += ek
    for i in range(m):
        d = den[i]
        if d < floor:  # clamp(min=1e-6); NaN stays NaN
            d = floor
        o[i] = b[i] + num[i] / d


@numba.njit(cache=True, nogil=True)
def _sce_combine_span(out: np.ndarray, base: np.ndarray, ds: tuple[np.ndarray, ...], n_experts: int,
                      keep: np.ndarray, masked: bool, w: np.ndarray, s: int, e: int) -> None:
    """`sce_combine` on elements [s, e)."""
    mk = np.ones(_SCE_TILE, np.float32)
    sg = np.empty(_SCE_TILE, np.float32)
    num = np.empty(_SCE_TILE, np.float32)
    den = np.empty(_SCE_TILE, np.float32)
    for t0 in range(s, e, _SCE_TILE):
        m = min(_SCE_TILE, e - t0)
        _sce_combine_tile(out[t0 - s:t0 - s + m], base[t0:t0 + m], ds, t0, m, n_experts,
                          keep[t0:t0 + m] if masked else keep[0:0], masked, w, mk, sg, num, den)


@numba.njit(cache=True, nogil=True)
def _sce_combine_raw_span(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                          n_experts: int, keep: np.ndarray, masked: bool, w: np.ndarray, s: int, e: int) -> None:
    """`sce_combine_raw` on elements [s, e)."""
    mk = np.ones(_SCE_TILE, np.float32)
    sg = np.empty(_SCE_TILE, np.float32)
    num = np.empty(_SCE_TILE, np.float32)
    den = np.empty(_SCE_TILE, np.float32)
    tile = np.empty((n_experts, _SCE_TILE), np.float32)
    for t0 in range(s, e, _SCE_TILE):
        m = min(_SCE_TILE, e - t0)
        delta_tile(tile, base, raws, read, n_experts, t0, m)
        _sce_combine_tile(out[t0 - s:t0 - s + m], base[t0:t0 + m], tile, 0, m, n_experts,
                          keep[t0:t0 + m] if masked else keep[0:0], masked, w, mk, sg, num, den)


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_combine_raw(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                    n_experts: int, keep: np.ndarray, masked: bool, w: np.ndarray) -> None:
    """`sce_combine` with Δ_k formed a tile at a time from the stored values (flat) and their read map
    (`delta_tile`)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _sce_combine_raw_span(out[s:e], base, raws, read, n_experts, keep, masked, w, s, e)


@numba.njit(cache=True, nogil=True, parallel=True)
def sce_combine(out: np.ndarray, base: np.ndarray, ds: tuple[np.ndarray, ...], n_experts: int, keep: np.ndarray,
                masked: bool, w: np.ndarray) -> None:
    """out = θ₀ + Σ_k t_k·(w_k·erase_k) / clamp(Σ_k w_k·erase_k, 1e-6) over the first out.shape[0] elements,
    t_k = Δ_k·float32(keep) (``masked``) or Δ_k, erase_k = sign(t_k) == (Σ_k t_k >= 0 ? 1 : -1), `w` the
    normalized float32 weights: sce's `_combine` per element, every sum over k in order into +0.0 (torch's
    order along dim 0 away from an array's last columns, see `Sce`), sign(NaN) = 0 as torch's. In chunks on
    numba's threads (each element's value is its own)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _sce_combine_span(out[s:e], base, ds, n_experts, keep, masked, w, s, e)


# -- the same kernels on numba's threads -----------------------------------------------------------------------
#
# Each driver splits its elements into contiguous chunks, runs the serial kernel above on each chunk in parallel,
# and combines what the chunks give by integer sums or per element: the bits are those of the serial kernel,
# whatever the number of threads (`NUMBA_NUM_THREADS`) or chunks. Arrays shorter than two chunks run serially.

PAR_CHUNK = 1 << 17  # elements per chunk at least: a chunk's work (~0.1 ms) outweighs handing it to a thread
_PAR_ALIGN = 1 << 12  # chunk boundaries on multiples of this (whole tiles of the kernels above)
_PAR_RADIX_CHUNK = 1 << 20  # a radix chunk clears and sums its own (2, RADIX_BINS) histogram: larger chunks
_PAR_CHUNKS = 16  # chunks at most (a fixed number, not one per thread: numba cannot cache a kernel that asks)


@numba.njit(nogil=True)
def n_chunks(n: int, least: int) -> int:
    """How many chunks of at least `least` elements."""
    return max(1, min(_PAR_CHUNKS, n // least))


@numba.njit(nogil=True)
def chunk_span(n: int, c: int, t: int) -> tuple[int, int]:
    """Chunk t of c over [0, n): its [start, end), both multiples of `_PAR_ALIGN` except the last end."""
    s = (n * t // c) // _PAR_ALIGN * _PAR_ALIGN
    e = n if t == c - 1 else (n * (t + 1) // c) // _PAR_ALIGN * _PAR_ALIGN
    return s, e


@numba.njit(cache=True, nogil=True, parallel=True)
def widen_into_par(out: np.ndarray, raw: np.ndarray) -> None:
    """`widen_into` in chunks."""
    n = raw.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        widen_into(out[s:e], raw[s:e])


@numba.njit(cache=True, nogil=True, parallel=True)
def random_keep_par(keep: np.ndarray, b: np.ndarray, x: np.ndarray, u: np.ndarray, p: np.ndarray, p_step: int,
                    l1: bool, acc_kept: np.ndarray, acc_dropped: np.ndarray) -> None:
    """`random_keep` in chunks; each chunk's exact sums in its own accumulators, added into the callers' (exact
    sums do not depend on how the values are split)."""
    n = keep.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    if c == 1:
        random_keep(keep, b, x, u, p, p_step, l1, acc_kept, acc_dropped)
        return
    parts = np.zeros((c, 2, acc_kept.shape[0]), np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        pt = p[s:e] if p_step != 0 else p
        random_keep(keep[s:e], b[s:e], x[s:e], u[s:e], pt, p_step, l1, parts[t, 0], parts[t, 1])
    if l1:
        for t in range(c):
            acc_kept += parts[t, 0]
            acc_dropped += parts[t, 1]


@numba.njit(cache=True, nogil=True, parallel=True)
def masked_delta_span_par(mixed: np.ndarray, b: np.ndarray, x: np.ndarray, keep: np.ndarray, p: np.ndarray,
                          p_step: int, mode: int, scale: np.float32, w: np.float32) -> None:
    """`masked_delta_span` in chunks."""
    n = mixed.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        pt = p[s:e] if p_step != 0 else p
        masked_delta_span(mixed[s:e], b[s:e], x[s:e], keep[s:e], pt, p_step, mode, scale, w)


@numba.njit(cache=True, nogil=True, parallel=True)
def ties_masked_span_par(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray,
                         b: np.ndarray, x: np.ndarray, keep: np.ndarray, p: np.ndarray, p_step: int, mode: int,
                         scale: np.float32, w: np.float32, weights: bool, init: bool) -> None:
    """`ties_masked_span` in chunks (WP, WN may be empty when not ``weights``)."""
    n = S.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        pt = p[s:e] if p_step != 0 else p
        ws, we = (s, e) if weights else (0, 0)
        ties_masked_span(S[s:e], P[s:e], N[s:e], WP[ws:we], WN[ws:we], b[s:e], x[s:e], keep[s:e], pt, p_step,
                         mode, scale, w, weights, init)


@numba.njit(cache=True, nogil=True, parallel=True)
def dare_delta_span_par(mixed: np.ndarray, b: np.ndarray, x: np.ndarray, u: np.ndarray, dens: np.float32,
                        w: np.float32) -> None:
    """`dare_delta_span` in chunks."""
    n = mixed.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        dare_delta_span(mixed[s:e], b[s:e], x[s:e], u[s:e], dens, w)


@numba.njit(cache=True, nogil=True, parallel=True)
def ties_dare_span_par(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray,
                       b: np.ndarray, x: np.ndarray, u: np.ndarray, dens: np.float32, w: np.float32, weights: bool,
                       init: bool) -> None:
    """`ties_dare_span` in chunks (WP, WN may be empty when not ``weights``)."""
    n = S.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        ws, we = (s, e) if weights else (0, 0)
        ties_dare_span(S[s:e], P[s:e], N[s:e], WP[ws:we], WN[ws:we], b[s:e], x[s:e], u[s:e], dens, w, weights,
                       init)


@numba.njit(cache=True, nogil=True, parallel=True)
def masked_delta_par(out: np.ndarray, base: np.ndarray, raw: np.ndarray, lo: np.float32, hi: np.float32,
                     test_lo: bool, band: bool, w: np.float32) -> bool:
    """`masked_delta` in chunks; every element finite when every chunk's are."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    finite = np.zeros(c, np.bool_)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        finite[t] = masked_delta(out[s:e], base[s:e], raw[s:e], lo, hi, test_lo, band, w)
    return bool(finite.all())


@numba.njit(cache=True, nogil=True, parallel=True)
def absdelta_par(out: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray) -> None:
    """`absdelta` with each range in chunks (ranges in order, so each range's place in `out` is known)."""
    o = 0
    for r in range(ranges.shape[0]):
        s0, e0 = ranges[r, 0], ranges[r, 1]
        n = e0 - s0
        c = n_chunks(n, PAR_CHUNK)
        for t in numba.prange(c):
            s, e = chunk_span(n, c, t)
            y, b, x = out[o + s:o + e], base[s0 + s:s0 + e], raw[s0 + s:s0 + e]
            for i in range(e - s):
                y[i] = abs(widen(x[i]) - b[i])
        o += n


@numba.njit(cache=True, nogil=True, parallel=True)
def _radix_count_par(bits: np.ndarray, prefixes: np.ndarray, low: bool, hist: np.ndarray) -> None:
    """`_radix_count` in chunks, each into its own histogram, summed in chunk order (integer counts)."""
    n = bits.shape[0]
    c = n_chunks(n, _PAR_RADIX_CHUNK)
    if c == 1:
        _radix_count(bits, prefixes, low, hist)
        return
    parts = np.zeros((c, hist.shape[0], hist.shape[1]), np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _radix_count(bits[s:e], prefixes, low, parts[t])
    for t in range(c):
        hist += parts[t]


@numba.njit(cache=True, nogil=True)
def radix_count_high_par(bits: np.ndarray, hist: np.ndarray) -> None:
    """`radix_count_high` on numba's threads."""
    _radix_count_par(bits, np.zeros(1, np.uint32), False, hist.reshape(1, RADIX_BINS))


@numba.njit(cache=True, nogil=True)
def radix_count_low_par(bits: np.ndarray, prefixes: np.ndarray, hist: np.ndarray) -> None:
    """`radix_count_low` on numba's threads."""
    _radix_count_par(bits, prefixes, True, hist)


_HIST_TILE = 1024  # |Δ| patterns formed a tile at a time (a loop that vectorizes), then counted


@numba.njit(cache=True, nogil=True)
def absdelta_bits_tile(out: np.ndarray, b: np.ndarray, x: np.ndarray) -> None:
    """out = the bit patterns of |θ_k − θ₀| of one tile."""
    for i in range(out.shape[0]):
        out[i] = f32_to_bits(abs(widen(x[i]) - b[i]))


@numba.njit(cache=True, nogil=True, parallel=True)
def _absdelta_hist_chunks(base: np.ndarray, raw: np.ndarray, parts: np.ndarray) -> None:
    """parts[t, bits(|Δ|) >> 16] += 1 over chunk t of the flat tensor (`chunk_span`, len(parts) chunks); counted
    in `_RADIX_ROWS` interleaved rows, so runs of equal patterns (zeros, BF16 ties) do not wait on one counter."""
    n = base.shape[0]
    c = parts.shape[0]
    R = _RADIX_ROWS
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        rows = np.zeros((R, HIST_BINS), np.int64)
        tile = np.empty(_HIST_TILE, np.uint32)
        for t0 in range(s, e, _HIST_TILE):
            m = min(_HIST_TILE, e - t0)
            absdelta_bits_tile(tile[:m], base[t0:t0 + m], raw[t0:t0 + m])
            q = m // R * R
            for i in range(0, q, R):
                for r in range(R):
                    rows[r, tile[i + r] >> np.uint32(16)] += 1
            for i in range(q, m):
                rows[0, tile[i] >> np.uint32(16)] += 1
        h = parts[t]
        for r in range(R):
            for j in range(HIST_BINS):
                h[j] += rows[r, j]


@numba.njit(cache=True, nogil=True, parallel=True)
def _absdelta_low_chunks(base: np.ndarray, raw: np.ndarray, prefixes: np.ndarray, parts: np.ndarray) -> None:
    """parts[t, j, bits(|Δ|) & 0xFFFF] += 1 over chunk t of the flat tensor, for the patterns whose top 16 bits
    are prefixes[j] (one or two): branch-free, the others into a spare bin that is dropped, in interleaved
    rows as `_absdelta_hist_chunks`."""
    n = base.shape[0]
    c = parts.shape[0]
    m = prefixes.shape[0]
    R = _RADIX_ROWS
    p0, p1 = prefixes[0], prefixes[m - 1]
    off1 = np.uint32((m - 1) * RADIX_BINS)
    spare = np.uint32(m * RADIX_BINS)
    lowmask = np.uint32(0xFFFF)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        rows = np.zeros((R, m * RADIX_BINS + 1), np.int64)
        tile = np.empty(_HIST_TILE, np.uint32)
        for t0 in range(s, e, _HIST_TILE):
            mt = min(_HIST_TILE, e - t0)
            absdelta_bits_tile(tile[:mt], base[t0:t0 + mt], raw[t0:t0 + mt])
            for i in range(mt):
                v = tile[i]
                top = v >> np.uint32(16)
                tile[i] = (v & lowmask) if top == p0 else (off1 + (v & lowmask) if top == p1 else spare)
            q = mt // R * R
            for i in range(0, q, R):
                for r in range(R):
                    rows[r, tile[i + r]] += 1
            for i in range(q, mt):
                rows[0, tile[i]] += 1
        h = parts[t]
        for r in range(R):
            for j in range(m):
                for k in range(RADIX_BINS):
                    h[j, k] += rows[r, j * RADIX_BINS + k]


def kth_largest_abs_deltas(base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, n_total: int, ks: list[int]
                           ) -> list[float] | None:
    """The k-th largest |Δ| of a tensor of `n_total` elements read on `ranges` (sorted, disjoint [start, stop)
    rows; `raw` its stored values, flat) and 0 elsewhere (its unread elements equal the base), for each k of `ks`
    (1 <= k <= n_total; at most two distinct top-16-bit prefixes among them), on numba's threads: a radix select
    straight from the stored values, one pass counting the top 16 bits of every |Δ| read and one counting the
    low 16 bits of those with the ks' prefixes, each chunk into its own histogram (integer sums: the same for
    any number of threads). Equal to `kth_largest_abs_delta` (``torch.sort(|Δ|)``'s values); None when some
    |Δ| is inf or NaN (the caller's literal path then orders them)."""
    spans = [(int(s0), int(e0)) for s0, e0 in ranges if e0 > s0]
    hist = np.zeros(HIST_BINS, np.int64)
    for s0, e0 in spans:
        parts = np.zeros((n_chunks(e0 - s0, _PAR_RADIX_CHUNK), HIST_BINS), np.int64)
        _absdelta_hist_chunks(base[s0:e0], raw[s0:e0], parts)
        hist += parts.sum(axis=0)
    if hist[_INF_PREFIX:].any():
        return None
    unread = n_total - sum(e0 - s0 for s0, e0 in spans)
    hist[0] += unread  # |Δ| = +0.0: pattern 0
    located = [locate_from_top(hist, k) for k in ks]
    prefixes = np.array(sorted({p for p, _ in located}), np.uint32)
    if prefixes.shape[0] > 2:
        raise ValueError("kth_largest_abs_deltas: at most two prefixes")
    low_hist = np.zeros((prefixes.shape[0], RADIX_BINS), np.int64)
    for s0, e0 in spans:
        parts = np.zeros((n_chunks(e0 - s0, _PAR_RADIX_CHUNK), prefixes.shape[0], RADIX_BINS), np.int64)
        _absdelta_low_chunks(base[s0:e0], raw[s0:e0], prefixes, parts)
        low_hist += parts.sum(axis=0)
    row = {int(p): j for j, p in enumerate(prefixes)}
    if unread and 0 in row:
        low_hist[row[0], 0] += unread
    out = []
    for k, (p, above) in zip(ks, located):
        lo16, _ = locate_from_top(low_hist[row[p]], k - above)
        out.append(float(np.array([(p << 16) | lo16], np.uint32).view(np.float32)[0]))
    return out


@numba.njit(cache=True, nogil=True, parallel=True)
def dare_keep_blocks(keep: np.ndarray, bits: np.ndarray, offsets: np.ndarray, b: np.ndarray, x: np.ndarray,
                     spans: np.ndarray, seeds: np.ndarray, d: np.float32, acc_kept: np.ndarray,
                     acc_dropped: np.ndarray) -> None:
    """DARE's mask of several blocks, drawn and used in one pass: block j (elements spans[j] = [start, end) of
    the flat tensor) gets keep = u < d with u its own stream (seed ``seeds[j]``, `mt19937`), a tile at a time,
    and the exact sums (`exact_sum`) of the kept and of the dropped |Δ| of that tile while it is in cache. The
    mask goes into `keep` (bool, indexed by element) or, where `bits` is not empty, packed into `bits` instead
    (`pack_bits`: block j's from byte offsets[j]; `keep` is then not written). The same mask and sums as
    `random_keep` on each block's ``torch.rand`` uniforms, without the uniforms in memory; blocks in contiguous
    chunks on numba's threads, each chunk's sums in its own accumulators, added after (exact: the same for any
    thread count)."""
    nbk = spans.shape[0]
    c = max(1, min(_PAR_CHUNKS, nbk))
    parts = np.zeros((c, 2, acc_kept.shape[0]), np.int64)
    T = _MT_TILE
    packed = bits.shape[0] > 0
    for t in numba.prange(c):
        state = np.empty(mt19937.STATE_WORDS, np.uint32)
        u = np.empty(T, np.float32)
        a = np.empty(T, np.float32)
        words = np.empty(T // 8 + 1, np.uint64)
        tile = words.view(np.bool_)
        for j in range(nbk * t // c, nbk * (t + 1) // c):
            mt19937.stream_start(state, seeds[j])
            for t0 in range(spans[j, 0], spans[j, 1], T):
                m = min(T, spans[j, 1] - t0)
                mt19937.stream_fill_words(u[:m], state)  # whole tiles of words: only a block's last tile is short
                kp = tile[:m] if packed else keep[t0:t0 + m]
                for i in range(m):
                    kp[i] = u[i] < d
                if packed:
                    pack_bits(bits, offsets[j] + (t0 - spans[j, 0]) // 8, words, m)
                top = absdelta_top(a, x[t0:t0 + m], b[t0:t0 + m])
                exact_sum.add_split_top(parts[t, 0], parts[t, 1], a[:m], kp, top)
    for t in range(c):
        acc_kept += parts[t, 0]
        acc_dropped += parts[t, 1]


@numba.njit(cache=True, nogil=True)
def _ties_add_terms_span(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, D: np.ndarray,
                         w: np.float32, weights: bool) -> None:
    """One span of `ties_add_terms`."""
    for i in range(S.shape[0]):
        _ties_accumulate(S, P, N, WP, WN, i, D[i], w, weights, False)


@numba.njit(cache=True, nogil=True, parallel=True)
def ties_add_terms(S: np.ndarray, P: np.ndarray, N: np.ndarray, WP: np.ndarray, WN: np.ndarray, D: np.ndarray,
                   w: np.float32, weights: bool) -> None:
    """The TIES sums of finite weighted terms D (= T·w) on one span: S += D, P += max(D, 0), N += min(D, 0) and,
    with ``weights``, WP += w·(D > 0), WN += w·(D < 0) — numpy's `TiesFold._combine` in one pass (a ±0 term adds
    nothing to sums started at +0.0 and holding no −0.0), in chunks on numba's threads (WP, WN may be empty
    without ``weights``)."""
    n = S.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        ws, we = (s, e) if weights else (0, 0)
        _ties_add_terms_span(S[s:e], P[s:e], N[s:e], WP[ws:we], WN[ws:we], D[s:e], w, weights)
