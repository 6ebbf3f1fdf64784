"""The geometric methods' per-tensor passes (numba): the Gram matrix of ``[θ₀, v_1 … v_K]`` and the weighted sum
``a₀·θ₀ + Σ c_k·v_k``, straight from the experts' stored values or from float32 vectors, on numba's threads.

**The Gram matrix's summation order is fixed here, so it is the definition** (docs/SEMANTICS.md, "Inner
products"): every value is widened exactly to float64 (a product of two float32 values is exact there); the
tensor is cut into chunks (`merge.chunk_span`, a cut that depends on its size only); in a chunk, element ``e``
adds its product to lane ``e mod LANES`` (each lane a float64 sum from +0.0, in element order); the chunk's sum
is its lanes added in order from +0.0, and the total the chunks' sums in order from +0.0. Neither the thread
count nor where the values come from changes a bit: `gram_pass` forms each vector's tile from the stored bytes
(``v_k = widen(θ_k) − θ₀`` on the blocks read, 0 elsewhere, or ``v_k = widen(θ_k)`` for slerp) or copies it
from a float32 vector, and both give the same float64 tile.

`combine_pass` does, per element, exactly the float32 operations of the numpy form ``out = θ₀·a₀``
(``out = θ₀`` when a₀ is 1), then ``out += v_k·c_k`` for k in order: the same bits.
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels.float_bits import widen
from mergepipe_db.kernels.merge import PAR_CHUNK, chunk_span, n_chunks, pack

TILE = 2048  #: elements per tile (divides `merge._PAR_ALIGN`; nine float64 rows of it stay in L2)
LANES = 64  #: the float64 sums of a pair, one per element index mod LANES, over a chunk

#: how `gram_pass` / `combine_pass` form vector k from ``sources[k]`` (its index into `raws` or `vecs`)
FROM_VEC = 0  # a float32 vector, taken as it is
FROM_DELTA = 1  # stored values: widen(θ_k) − θ₀ on the blocks read (``selected``), 0.0 elsewhere
FROM_THETA = 2  # stored values: widen(θ_k), read whole


def pass_inputs(raws: list[np.ndarray], vecs: list[np.ndarray], kinds: list[int], sources: list[int],
                selected: np.ndarray) -> tuple:
    """(raws, vecs, kinds, sources, selected) as `gram_pass` and `combine_pass` take them: the stored values and
    float32 vectors packed (`merge.pack`; an empty one where there is none, so every call compiles to one of a
    few signatures), kinds and sources as int64."""
    raw_dtype = raws[0].dtype if raws else np.uint16
    return (pack(raws or [np.empty(0, raw_dtype)]), pack(vecs or [np.empty(0, np.float32)]),
            np.asarray(kinds, np.int64), np.asarray(sources, np.int64), selected)


@numba.njit(cache=True, nogil=True)
def _fill(X: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], vecs: tuple[np.ndarray, ...],
          kinds: np.ndarray, sources: np.ndarray, selected: np.ndarray, bounds: np.ndarray, t0: int, m: int) -> None:
    """Rows of the float64 tile X for elements [t0, t0 + m): row 0 θ₀, row 1 + k vector k; columns m.. up to
    the next multiple of `LANES` are 0.0 (they add +0.0 to a lane, which changes no sum that starts at +0.0)."""
    w = (m + LANES - 1) // LANES * LANES
    b = base[t0:t0 + m]
    x0 = X[0]
    for i in range(m):
        x0[i] = np.float64(b[i])
    for i in range(m, w):
        x0[i] = 0.0
    for k in range(kinds.shape[0]):
        xk = X[1 + k]
        for i in range(m, w):
            xk[i] = 0.0
        kind = kinds[k]
        if kind == FROM_VEC:
            v = vecs[sources[k]][t0:t0 + m]
            for i in range(m):
                xk[i] = np.float64(v[i])
        elif kind == FROM_THETA:
            r = raws[sources[k]][t0:t0 + m]
            for i in range(m):
                xk[i] = np.float64(widen(r[i]))
        else:  # FROM_DELTA, block by block: the rows of a block not read are never touched
            r = raws[sources[k]]
            sel = selected[sources[k]]
            blk = np.searchsorted(bounds, t0, side="right") - 1
            s = t0
            while s < t0 + m:
                e = min(bounds[blk + 1], t0 + m)
                x = xk[s - t0:e - t0]  # zero-based slices, so that the loops vectorize
                if sel[blk]:
                    rs, bs = r[s:e], base[s:e]
                    for i in range(e - s):
                        x[i] = np.float64(widen(rs[i]) - bs[i])
                else:
                    x[:] = 0.0
                s = e
                blk += 1


@numba.njit(cache=True, nogil=True)
def _tile_products(X: np.ndarray, first: int, rows: int, w: int, lanes: np.ndarray) -> None:
    """lanes[p, l] += X[i, e]·X[j, e] for the elements e < w of the tile with e mod `LANES` = l, for the pairs
    first <= i <= j < rows in row-major order p: every lane its own sum in element order (the loop over l
    vectorizes without reassociating anything)."""
    p = 0
    for i in range(first, rows):
        for j in range(i, rows):
            acc = lanes[p]
            for e0 in range(0, w, LANES):
                xs = X[i, e0:e0 + LANES]
                ys = X[j, e0:e0 + LANES]
                for q in range(LANES):
                    acc[q] += xs[q] * ys[q]
            p += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def gram_pass(base: np.ndarray, raws: tuple[np.ndarray, ...], vecs: tuple[np.ndarray, ...], kinds: np.ndarray,
              sources: np.ndarray, selected: np.ndarray, bounds: np.ndarray, with_base: bool) -> np.ndarray:
    """The (1 + K, 1 + K) float64 Gram matrix of ``[θ₀, v_1 … v_K]`` (`base`: θ₀ flat, float32; vector k formed
    as ``kinds[k]`` says from ``raws[sources[k]]`` or ``vecs[sources[k]]``; ``selected[j, b]``: block b of
    ``raws[j]`` was read, `bounds` the blocks' element offsets), summed in the order the module states.
    Without `with_base`, θ₀'s row and column are left 0 and their products not formed."""
    n = base.shape[0]
    rows = 1 + kinds.shape[0]
    first = 0 if with_base else 1
    pairs = (rows - first) * (rows - first + 1) // 2
    c = n_chunks(n, PAR_CHUNK)
    parts = np.zeros((c, pairs), np.float64)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        X = np.empty((rows, TILE), np.float64)
        lanes = np.zeros((pairs, LANES), np.float64)
        for t0 in range(s, e, TILE):
            m = min(TILE, e - t0)
            _fill(X, base, raws, vecs, kinds, sources, selected, bounds, t0, m)
            _tile_products(X, first, rows, (m + LANES - 1) // LANES * LANES, lanes)
        for p in range(pairs):
            acc = 0.0
            for q in range(LANES):
                acc += lanes[p, q]
            parts[t, p] = acc
    total = np.zeros(pairs, np.float64)
    for t in range(c):
        total += parts[t]
    g = np.zeros((rows, rows), np.float64)
    p = 0
    for i in range(first, rows):
        for j in range(i, rows):
            g[i, j] = total[p]
            g[j, i] = total[p]
            p += 1
    return g


@numba.njit(cache=True, nogil=True)
def _combine_span(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], vecs: tuple[np.ndarray, ...],
                  kinds: np.ndarray, sources: np.ndarray, selected: np.ndarray, bounds: np.ndarray, a0: np.float32,
                  a0_one: bool, c: np.ndarray, s: int, e: int) -> None:
    zero = np.float32(0.0)
    o, b = out[s:e], base[s:e]  # zero-based slices, so that the loops vectorize
    if a0_one:
        o[:] = b
    else:
        for i in range(o.shape[0]):
            o[i] = b[i] * a0
    for k in range(kinds.shape[0]):
        ck = c[k]
        kind = kinds[k]
        if kind == FROM_VEC:
            v = vecs[sources[k]][s:e]
            for i in range(o.shape[0]):
                o[i] = o[i] + v[i] * ck
        elif kind == FROM_THETA:
            r = raws[sources[k]][s:e]
            for i in range(o.shape[0]):
                o[i] = o[i] + widen(r[i]) * ck
        else:
            r = raws[sources[k]]
            sel = selected[sources[k]]
            blk = np.searchsorted(bounds, s, side="right") - 1
            q = s
            while q < e:
                qe = min(bounds[blk + 1], e)
                ob = out[q:qe]
                if sel[blk]:
                    rb, bb = r[q:qe], base[q:qe]
                    for i in range(qe - q):
                        ob[i] = ob[i] + (widen(rb[i]) - bb[i]) * ck
                else:
                    for i in range(qe - q):
                        ob[i] = ob[i] + zero * ck
                q = qe
                blk += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def combine_pass(out: np.ndarray, base: np.ndarray, raws: tuple[np.ndarray, ...], vecs: tuple[np.ndarray, ...],
                 kinds: np.ndarray, sources: np.ndarray, selected: np.ndarray, bounds: np.ndarray, a0: np.float32,
                 a0_one: bool, c: np.ndarray) -> None:
    """out = θ₀·a0 (θ₀ when `a0_one`), then out += v_k·c[k] for k in order (float32; `c` float32), the vectors
    formed as in `gram_pass`."""
    n = base.shape[0]
    nc = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(nc):
        s, e = chunk_span(n, nc, t)
        _combine_span(out, base, raws, vecs, kinds, sources, selected, bounds, a0, a0_one, c, s, e)
