"""Kernels (numba) of the whole-tensor methods (`operators/gather.py`: ram, ramplus_tl, arcee_fusion; the
gathered inputs of every `GatherFold`).

Each does, per element, the float32 operations of the operator's numpy/torch formula in the same order (no
fast-math: nothing reassociated or contracted), so results are identical bit for bit; counts are integers.
Loops run over tiles of zero-based slices so LLVM vectorizes them. All kernels release the GIL.
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels.float_bits import bits_to_f32, f32_to_bits, widen
from mergepipe_db.kernels.merge import PAR_CHUNK, RAW_TILE, chunk_span, delta_tile, n_chunks

_TILE = RAW_TILE  # elements per tile: a tile's count and accumulator stay in L1 across the experts
_SIGN = np.uint32(0x80000000)
_EXP = np.uint32(0x7F800000)


@numba.njit(cache=True, nogil=True)
def _gather_span(out: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray, s: int, e: int,
                 delta: bool) -> None:
    """`gather_delta` (``delta``) or `gather_theta` on elements [s, e) only."""
    zero = np.float32(0.0)
    prev = s
    for r in range(ranges.shape[0]):
        rs, re = max(ranges[r, 0], s), min(ranges[r, 1], e)
        if rs >= re:
            continue
        if delta:
            out[prev:rs] = zero
            o, b, x = out[rs:re], base[rs:re], raw[rs:re]
            for i in range(re - rs):
                o[i] = widen(x[i]) - b[i]
        else:
            out[prev:rs] = base[prev:rs]
            o, x = out[rs:re], raw[rs:re]
            for i in range(re - rs):
                o[i] = widen(x[i])
        prev = re
    if delta:
        out[prev:e] = zero
    else:
        out[prev:e] = base[prev:e]


@numba.njit(cache=True, nogil=True, parallel=True)
def gather_delta(out: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray) -> None:
    """out = Δ = θ_k − θ₀ on the selected element `ranges` of θ_k's stored values `raw` (flat), 0.0 elsewhere;
    in chunks on numba's threads."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _gather_span(out, base, raw, ranges, s, e, True)


@numba.njit(cache=True, nogil=True, parallel=True)
def gather_theta(out: np.ndarray, base: np.ndarray, raw: np.ndarray, ranges: np.ndarray) -> None:
    """out = θ_k: the stored values `raw` (flat) on the selected element `ranges`, θ₀ elsewhere; in chunks on
    numba's threads."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _gather_span(out, base, raw, ranges, s, e, False)


@numba.njit(cache=True, nogil=True)
def _fill_from_base(bits: np.ndarray, base: np.ndarray, s: int, e: int, shift: int) -> bool:
    """bits[s:e] = θ₀'s float32 patterns there shifted right by ``shift``; whether each is finite and exact."""
    low = np.uint32((1 << shift) - 1)
    ok = True
    o, b = bits[s:e], base[s:e]
    for i in range(e - s):
        v = f32_to_bits(b[i])
        ok &= ((v & _EXP) != _EXP) & ((v & low) == np.uint32(0))
        o[i] = v >> np.uint32(shift)
    return ok


@numba.njit(cache=True, nogil=True)
def map_read_tiles(bits: np.ndarray, base: np.ndarray, ranges: np.ndarray, shift: int, read: np.ndarray) -> bool:
    """The read map of one expert's stored values for `merge.delta_tile`: read[j] = 1 where tile j (`RAW_TILE`
    elements) holds an element of the element `ranges` (sorted, disjoint), else 0; in such a tile the elements
    outside the ranges are made θ₀'s (``bits``: the stored patterns, flat, BF16 as uint16 with ``shift`` 16,
    float32 as uint32 with ``shift`` 0; θ₀'s pattern shifted right), so the whole tile gives widen(θ_k) − θ₀ =
    +0.0 there, what `gather_delta` gives an element not read. Returns whether every such θ₀ was finite and kept
    exactly by the shift (if not, the stored values outside the ranges are spoilt; inside, untouched). Tiles
    with nothing read are not touched."""
    n = bits.shape[0]
    read[:] = 0
    nr = ranges.shape[0]
    for r in range(nr):
        if ranges[r, 1] > ranges[r, 0]:
            read[ranges[r, 0] // RAW_TILE:(ranges[r, 1] - 1) // RAW_TILE + 1] = 1
    ok = True
    prev = 0
    for r in range(nr + 1):
        g1 = ranges[r, 0] if r < nr else n
        if g1 > prev:  # a gap [prev, g1): only its first and last tiles may have been read
            a = prev // RAW_TILE
            if read[a]:
                ok &= _fill_from_base(bits, base, prev, min(g1, (a + 1) * RAW_TILE), shift)
            z = (g1 - 1) // RAW_TILE
            if z != a and read[z]:
                ok &= _fill_from_base(bits, base, z * RAW_TILE, g1, shift)
        if r < nr:
            prev = max(prev, ranges[r, 1])
    return ok


@numba.njit(cache=True, nogil=True)
def _ram_tile_counts(cnt: np.ndarray, deltas: np.ndarray, s: int, m: int, eps: np.float32) -> None:
    """cnt[:m] = c = Σ_k (|Δ_k| > ε) over elements s..s+m."""
    cnt[:m] = 0
    for k in range(deltas.shape[0]):
        d = deltas[k, s:s + m]
        for t in range(m):
            cnt[t] += np.int32(abs(d[t]) > eps)


@numba.njit(cache=True, nogil=True)
def _ram_counts_span(deltas: np.ndarray, eps: np.float32, shared: np.ndarray, unique: np.ndarray, s0: int,
                     e0: int) -> None:
    """`ram_counts` of elements [s0, e0), added into shared and unique."""
    cnt = np.empty(_TILE, np.int32)
    for s in range(s0, e0, _TILE):
        m = min(_TILE, e0 - s)
        _ram_tile_tally(cnt, deltas, s, m, eps, shared, unique)


@numba.njit(cache=True, nogil=True)
def _ram_tile_tally(cnt: np.ndarray, deltas: np.ndarray, s: int, m: int, eps: np.float32, shared: np.ndarray,
                    unique: np.ndarray) -> None:
    """ramplus_tl's counts of elements s..s+m of `deltas`, added into shared and unique."""
    _ram_tile_counts(cnt, deltas, s, m, eps)
    for k in range(deltas.shape[0]):
        d = deltas[k, s:s + m]
        sh = 0
        un = 0
        for t in range(m):
            nz = abs(d[t]) > eps
            sh += np.int64(nz & (cnt[t] > 1))
            un += np.int64(nz & (cnt[t] == 1))
        shared[k] += sh
        unique[k] += un


@numba.njit(cache=True, nogil=True)
def _ram_counts_raw_span(base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray, n_experts: int,
                         eps: np.float32, shared: np.ndarray, unique: np.ndarray, s0: int, e0: int) -> None:
    """`ram_counts_raw` of elements [s0, e0), added into shared and unique."""
    cnt = np.empty(_TILE, np.int32)
    tile = np.empty((n_experts, _TILE), np.float32)
    for s in range(s0, e0, _TILE):
        m = min(_TILE, e0 - s)
        delta_tile(tile, base, raws, read, n_experts, s, m)
        _ram_tile_tally(cnt, tile, 0, m, eps, shared, unique)


@numba.njit(cache=True, nogil=True, parallel=True)
def ram_counts(deltas: np.ndarray, eps: np.float32, shared: np.ndarray, unique: np.ndarray) -> None:
    """ramplus_tl's counts of expert k (`deltas`: (K, n) float32): shared[k] += #(|Δ_k| > ε and c > 1),
    unique[k] += #(|Δ_k| > ε and c == 1), with c = Σ_k (|Δ_k| > ε). In chunks on numba's threads, each
    chunk's counts its own, added after (integers: the same for any thread count)."""
    n = deltas.shape[1]
    c = n_chunks(n, PAR_CHUNK)
    parts = np.zeros((c, 2, deltas.shape[0]), np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _ram_counts_span(deltas, eps, parts[t, 0], parts[t, 1], s, e)
    for t in range(c):
        shared += parts[t, 0]
        unique += parts[t, 1]


@numba.njit(cache=True, nogil=True, parallel=True)
def ram_counts_raw(base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray, n_experts: int,
                   eps: np.float32, shared: np.ndarray, unique: np.ndarray) -> None:
    """`ram_counts` with Δ_k formed a tile at a time from the stored values (flat) and their read map
    (`merge.delta_tile`), not read from a gathered float32 copy."""
    n = base.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    parts = np.zeros((c, 2, n_experts), np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _ram_counts_raw_span(base, raws, read, n_experts, eps, parts[t, 0], parts[t, 1], s, e)
    for t in range(c):
        shared += parts[t, 0]
        unique += parts[t, 1]


@numba.njit(cache=True, nogil=True, error_model="numpy")  # no zero-division check: the loop vectorizes
def _ram_combine_span(out: np.ndarray, base: np.ndarray, deltas: np.ndarray, eps: np.float32, lam: np.ndarray,
                      s0: int, e0: int) -> None:
    """`ram_combine` of elements [s0, e0)."""
    cnt = np.empty(_TILE, np.int32)
    den = np.empty(_TILE, np.float32)
    acc = np.empty(_TILE, np.float32)
    for s in range(s0, e0, _TILE):
        m = min(_TILE, e0 - s)
        _ram_tile_combine(out[s:s + m], base[s:s + m], deltas, s, m, eps, lam, cnt, den, acc)


@numba.njit(cache=True, nogil=True, error_model="numpy")  # no zero-division check: the loop vectorizes
def _ram_tile_combine(o: np.ndarray, b: np.ndarray, deltas: np.ndarray, s: int, m: int, eps: np.float32,
                      lam: np.ndarray, cnt: np.ndarray, den: np.ndarray, acc: np.ndarray) -> None:
    """`ram_combine` of elements s..s+m of `deltas` into o (θ₀ there: b); cnt, den, acc: tile scratch."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    _ram_tile_counts(cnt, deltas, s, m, eps)
    for t in range(m):
        den[t] = np.float32(max(cnt[t], 1))
        acc[t] = zero
    for k in range(deltas.shape[0]):
        d = deltas[k, s:s + m]
        w = lam[k]
        for t in range(m):
            z = d[t] if abs(d[t]) > eps else zero
            u = z * (one if cnt[t] == 1 else zero) * w
            acc[t] = acc[t] + (u + (z * (one if cnt[t] > 1 else zero)) / den[t])
    for t in range(m):
        o[t] = b[t] + acc[t]


@numba.njit(cache=True, nogil=True)
def _ram_combine_raw_span(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                          n_experts: int, eps: np.float32, lam: np.ndarray, s0: int, e0: int) -> None:
    """`ram_combine_raw` of elements [s0, e0)."""
    cnt = np.empty(_TILE, np.int32)
    den = np.empty(_TILE, np.float32)
    acc = np.empty(_TILE, np.float32)
    tile = np.empty((n_experts, _TILE), np.float32)
    for s in range(s0, e0, _TILE):
        m = min(_TILE, e0 - s)
        delta_tile(tile, base, raws, read, n_experts, s, m)
        _ram_tile_combine(out[s:s + m], base[s:s + m], tile, 0, m, eps, lam, cnt, den, acc)


NOT_UNIQUE = np.uint8(255)  #: `ramplus_raw`'s code of an element not updated by exactly one expert


@numba.njit(cache=True, nogil=True, error_model="numpy")  # no zero-division check: the loop vectorizes
def _ramplus_tile(o: np.ndarray, code: np.ndarray, b: np.ndarray, deltas: np.ndarray, m: int, eps: np.float32,
                  cnt: np.ndarray, den: np.ndarray, acc: np.ndarray, only: np.ndarray, who: np.ndarray,
                  shared: np.ndarray, unique: np.ndarray) -> None:
    """`ramplus_raw` of one tile (`deltas`: its (K, tile) Δ_k); cnt … who: tile scratch."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    _ram_tile_counts(cnt, deltas, 0, m, eps)
    for t in range(m):
        den[t] = np.float32(max(cnt[t], 1))
        acc[t] = zero
        only[t] = zero
        who[t] = 0
    for k in range(deltas.shape[0]):
        d = deltas[k, :m]
        sh = 0
        un = 0
        for t in range(m):
            nz = abs(d[t]) > eps
            z = d[t] if nz else zero
            u = z * (one if cnt[t] == 1 else zero) * one  # λ_k's place: where c != 1, u is ±0 or NaN for any λ_k
            acc[t] = acc[t] + (u + (z * (one if cnt[t] > 1 else zero)) / den[t])
            only[t] = only[t] + z  # where c == 1, the one z_k counted (the others are +0.0)
            who[t] += np.int32(k) if nz else np.int32(0)
            # `_ram_tile_tally`'s counts, in this loop: its own pass over the tile made the kernel 31 -> 43 ms
            sh += np.int64(nz & (cnt[t] > 1))
            un += np.int64(nz & (cnt[t] == 1))
        shared[k] += sh
        unique[k] += un
    for t in range(m):
        single = cnt[t] == 1
        o[t] = only[t] if single else b[t] + acc[t]
        code[t] = np.uint8(who[t]) if single else NOT_UNIQUE


@numba.njit(cache=True, nogil=True)
def _ramplus_raw_span(out: np.ndarray, code: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...],
                      read: np.ndarray, n_experts: int, eps: np.float32, shared: np.ndarray, unique: np.ndarray,
                      s0: int, e0: int) -> None:
    """`ramplus_raw` of elements [s0, e0), its counts added into shared and unique."""
    cnt = np.empty(_TILE, np.int32)
    who = np.empty(_TILE, np.int32)
    den = np.empty(_TILE, np.float32)
    acc = np.empty(_TILE, np.float32)
    only = np.empty(_TILE, np.float32)
    tile = np.empty((n_experts, _TILE), np.float32)
    for s in range(s0, e0, _TILE):
        m = min(_TILE, e0 - s)
        delta_tile(tile, base, raws, read, n_experts, s, m)
        _ramplus_tile(out[s:s + m], code[s:s + m], base[s:s + m], tile, m, eps, cnt, den, acc, only, who, shared,
                      unique)


@numba.njit(cache=True, nogil=True, parallel=True)
def ramplus_raw(out: np.ndarray, code: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...],
                read: np.ndarray, n_experts: int, eps: np.float32, shared: np.ndarray, unique: np.ndarray) -> None:
    """ramplus_tl's counts and its formula in one pass over the stored values (as `ram_combine_raw`; at most 255
    experts, ε > 0): shared and unique as `ram_counts_raw` adds them, and out = `ram_combine`'s value wherever
    c != 1, which does not depend on λ (each term's z_k·0·λ_k is ±0 or NaN, and a sum started at +0.0 is never
    −0.0, so the sign of a zero term never shows). Where c == 1, λ_k is not known before the counts are: out
    holds that element's one z_k and code its k, for `ramplus_unique` to finish; code is `NOT_UNIQUE`
    elsewhere."""
    n = base.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    parts = np.zeros((c, 2, n_experts), np.int64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _ramplus_raw_span(out, code, base, raws, read, n_experts, eps, parts[t, 0], parts[t, 1], s, e)
    for t in range(c):
        shared += parts[t, 0]
        unique += parts[t, 1]


@numba.njit(cache=True, nogil=True, parallel=True)
def ramplus_unique(out: np.ndarray, code: np.ndarray, base: np.ndarray, lam: np.ndarray) -> None:
    """Finish `ramplus_raw`'s elements updated by one expert k = code (out holding its z_k): `ram_combine`'s
    float32 operations there, ``θ₀ + (+0.0 + (z·1·λ_k + (z·0) / 1))`` (the other experts' terms are +0.0 and
    leave the sum as it is). Without a branch (a select: the loop vectorizes, and a code's mispredictions cost
    more than the formula)."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    lam_of = np.ones(256, np.float32)  # indexed by every code, NOT_UNIQUE's value unused
    lam_of[:lam.shape[0]] = lam
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        o, k, b = out[s:e], code[s:e], base[s:e]
        for i in range(e - s):
            z = o[i]
            v = b[i] + (zero + (z * one * lam_of[k[i]] + (z * zero) / one))
            o[i] = z if k[i] == NOT_UNIQUE else v


@numba.njit(cache=True, nogil=True, parallel=True)
def ram_combine(out: np.ndarray, base: np.ndarray, deltas: np.ndarray, eps: np.float32, lam: np.ndarray) -> None:
    """out = θ₀ + Σ_k (z_k·unique·λ_k + (z_k·overlap) / float32(max(c, 1))), summed in expert order into +0.0,
    with z_k = where(|Δ_k| > ε, Δ_k, 0.0), unique = (c == 1), overlap = (c > 1) as 1.0/0.0 factors (`deltas`:
    (K, n) float32; `lam`: float32 λ_k, 1.0 for ram). Each element's value is its own: chunks on numba's
    threads."""
    n = deltas.shape[1]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _ram_combine_span(out, base, deltas, eps, lam, s, e)


@numba.njit(cache=True, nogil=True, parallel=True)
def ram_combine_raw(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], read: np.ndarray,
                    n_experts: int, eps: np.float32, lam: np.ndarray) -> None:
    """`ram_combine` with Δ_k formed a tile at a time from the stored values and their read map (as
    `ram_counts_raw`)."""
    n = base.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _ram_combine_raw_span(out, base, raws, read, n_experts, eps, lam, s, e)


@numba.njit(cache=True, nogil=True)
def _importance_rows(out: np.ndarray, theta0: np.ndarray, theta1: np.ndarray, kl: np.ndarray, rn: int, r0: int,
                     r1: int) -> bool:
    """`fusion_importance` on rows [r0, r1)."""
    ok = True
    for r in range(r0, r1):
        s = r * rn
        o, a, b = out[s:s + rn], theta0[s:s + rn], theta1[s:s + rn]
        w = kl[r]
        for i in range(rn):
            v = abs(b[i] - a[i]) * w
            o[i] = v
            ok &= v == v
    return ok


@numba.njit(cache=True, nogil=True, parallel=True)
def fusion_importance(out: np.ndarray, theta0: np.ndarray, theta1: np.ndarray, kl: np.ndarray) -> bool:
    """out = |θ_1 − θ₀| · kl[row] (flat, rows of ``len(out) // len(kl)`` elements); False when some value is
    NaN. Chunks of rows on numba's threads."""
    rows = kl.shape[0]
    rn = out.shape[0] // rows
    c = min(rows, n_chunks(out.shape[0], PAR_CHUNK))
    oks = np.empty(c, np.bool_)
    for t in numba.prange(c):
        oks[t] = _importance_rows(out, theta0, theta1, kl, rn, rows * t // c, rows * (t + 1) // c)
    return bool(oks.all())


@numba.njit(inline="always")
def _order_key(x: np.float32) -> np.uint32:
    """A float32's bit pattern mapped so that unsigned order is numeric order (-0.0 just below +0.0; no NaN)."""
    b = f32_to_bits(x)
    return b ^ np.uint32(0xFFFFFFFF) if b & _SIGN else b | _SIGN


@numba.njit(inline="always")
def _from_order_key(key: np.uint32) -> np.float32:
    return bits_to_f32(key ^ _SIGN if key & _SIGN else key ^ np.uint32(0xFFFFFFFF))


@numba.njit(cache=True, nogil=True)
def _locate(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(bin, count below it) of the k-th smallest item (0-based) of a histogram over increasing keys."""
    seen = 0
    for h in range(hist.shape[0]):
        if seen + hist[h] > k:
            return h, seen
        seen += hist[h]
    return -1, seen


_ROWS = 4  # interleaved counter rows: runs of equal values (zero importances) do not wait on one counter
_ROWS_MIN = 1 << 18  # below this many elements one row: clearing and summing the rows would dominate


@numba.njit(cache=True, nogil=True)
def kth_smallest(a: np.ndarray, ks: np.ndarray, out: np.ndarray) -> None:
    """out[j] = the ks[j]-th smallest (0-based) of the float32 values `a` (no NaN): the value at ks[j] of the
    ascending sort, by radix select on order keys: one pass counts their top 16 bits and locates each ks[j]'s
    prefix, a second counts the low 16 bits of the keys with one of those (distinct) prefixes."""
    n = a.shape[0]
    sixteen = np.uint32(16)
    low_mask = np.uint32(0xFFFF)
    rows = _ROWS if n >= _ROWS_MIN else 1
    counts = np.zeros((rows, 1 << 16), np.int64)
    for i in range(n):
        counts[i & (rows - 1), _order_key(a[i]) >> sixteen] += 1
    high = counts.sum(axis=0)
    nk = ks.shape[0]
    prefixes = np.empty(nk, np.uint32)  # distinct prefixes, ascending (ks ascending)
    which = np.empty(nk, np.int64)
    below = np.empty(nk, np.int64)
    m = 0
    for j in range(nk):
        h, seen = _locate(high, ks[j])
        if m == 0 or prefixes[m - 1] != np.uint32(h):
            prefixes[m] = np.uint32(h)
            m += 1
        which[j] = m - 1
        below[j] = seen
    low = np.zeros((rows, m, 1 << 16), np.int64)
    for i in range(n):
        key = _order_key(a[i])
        top = key >> sixteen
        for p in range(m):
            if top == prefixes[p]:
                low[i & (rows - 1), p, key & low_mask] += 1
    lows = low.sum(axis=0)
    for j in range(nk):
        lo, _ = _locate(lows[which[j]], ks[j] - below[j])
        out[j] = _from_order_key((prefixes[which[j]] << sixteen) | np.uint32(lo))


@numba.njit(cache=True, nogil=True, parallel=True)
def fusion_apply(out: np.ndarray, theta0: np.ndarray, theta1: np.ndarray, importance: np.ndarray,
                 threshold: np.float32) -> None:
    """out = θ₀ + (θ_1 − θ₀) · float32(importance >= threshold), in chunks on numba's threads."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        o, a, b, m = out[s:e], theta0[s:e], theta1[s:e], importance[s:e]
        for i in range(o.shape[0]):
            o[i] = a[i] + (b[i] - a[i]) * (one if m[i] >= threshold else zero)


# -- nearswap (`operators/nearswap.py`) ---------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, error_model="numpy")  # no zero-division check (m >= 1e-6 or NaN): it vectorizes
def _nearswap_span(out: np.ndarray, a: np.ndarray, b: np.ndarray, t: np.float32) -> None:
    """One span of `nearswap` (b: float32, or θ_1's stored values, widened here)."""
    eps = np.float32(1e-6)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(out.shape[0]):
        bi = widen(b[i])
        d = abs(a[i] - bi)
        m = d if (d >= eps or d != d) else eps  # np.maximum: NaN wins
        w = t / m
        if w < zero:  # np.clip(w, 0, 1): NaN stays NaN
            w = zero
        elif w > one:
            w = one
        out[i] = w * bi + (one - w) * a[i]


@numba.njit(cache=True, nogil=True, parallel=True)
def nearswap(out: np.ndarray, a: np.ndarray, b: np.ndarray, t: np.float32) -> None:
    """out = w·b + (1 − w)·a with w = clip(t / maximum(|a − b|, 1e-6), 0, 1), all in float32 in numpy's order
    (a = θ₀, b = θ_1, flat); in chunks on numba's threads (`merge.chunk_span`: elementwise, the bits do not
    depend on how many)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for k in numba.prange(c):
        s, e = chunk_span(n, c, k)
        _nearswap_span(out[s:e], a[s:e], b[s:e], t)


@numba.njit(cache=True, nogil=True, parallel=True)
def nearswap_raw(out: np.ndarray, a: np.ndarray, raw: np.ndarray, read: np.ndarray, t: np.float32) -> None:
    """`nearswap` with θ_1 from its stored values (flat) and read map (`merge.delta_tile`'s): widen(raw) on a
    tile read, θ₀ on a tile not read (θ_1 = θ₀ there, as `gather_theta` gives it)."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for k in numba.prange(c):
        s, e = chunk_span(n, c, k)
        for t0 in range(s, e, RAW_TILE):
            t1 = min(t0 + RAW_TILE, e)
            if read[t0 // RAW_TILE]:
                _nearswap_span(out[t0:t1], a[t0:t1], raw[t0:t1], t)
            else:
                _nearswap_span(out[t0:t1], a[t0:t1], a[t0:t1], t)
