"""The element-wise steps of karcher's float32 loop (`operators.geometric.karcher_float32`), fused (numba).

Each kernel does, per element, exactly the float32 operations of the torch formulas it replaces, in the same
order (numba compiles without fast-math: nothing is reassociated or contracted into FMAs), so the results are
identical bit for bit; the reductions (dots, norms) stay with torch. Being element-wise, they run in chunks on
numba's threads (`merge.chunk_span`) without changing a bit. The tangent sum takes up to eight inputs in one
pass, tile by tile, so each unit vector is read once an iteration and the sum is written once. ``units`` is a
tuple of flat float32 arrays of one length (`merge.pack`: padded to a power of two, so that a kernel is compiled
once per padded length). They release the GIL.
"""

from __future__ import annotations

import numba
import numpy as np

from mergepipe_db.kernels.merge import PAR_CHUNK, chunk_span, n_chunks

__all__ = ["divide", "in_place", "karcher_step", "karcher_tangent"]

_TILE = 4096  # elements of the tangent sum kept in L1 while every group of inputs adds to them


@numba.njit(cache=True, nogil=True)
def _add8(out: np.ndarray, mean: np.ndarray, u0: np.ndarray, u1: np.ndarray, u2: np.ndarray, u3: np.ndarray,
          u4: np.ndarray, u5: np.ndarray, u6: np.ndarray, u7: np.ndarray, d: np.ndarray, c: np.ndarray,
          first: bool) -> None:
    """out (+0.0 if `first`) += c[k]·(u_k − d[k]·mean) for k = 0 … 7 in order, per element."""
    zero = np.float32(0.0)
    d0, d1, d2, d3, d4, d5, d6, d7 = d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]
    c0, c1, c2, c3, c4, c5, c6, c7 = c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
    for i in range(out.shape[0]):
        m = mean[i]
        acc = zero if first else out[i]
        acc = acc + c0 * (u0[i] - d0 * m)
        acc = acc + c1 * (u1[i] - d1 * m)
        acc = acc + c2 * (u2[i] - d2 * m)
        acc = acc + c3 * (u3[i] - d3 * m)
        acc = acc + c4 * (u4[i] - d4 * m)
        acc = acc + c5 * (u5[i] - d5 * m)
        acc = acc + c6 * (u6[i] - d6 * m)
        out[i] = acc + c7 * (u7[i] - d7 * m)


@numba.njit(cache=True, nogil=True)
def _add4(out: np.ndarray, mean: np.ndarray, u0: np.ndarray, u1: np.ndarray, u2: np.ndarray, u3: np.ndarray,
          d: np.ndarray, c: np.ndarray, first: bool) -> None:
    """out (+0.0 if `first`) += c[k]·(u_k − d[k]·mean) for k = 0 … 3 in order, per element."""
    zero = np.float32(0.0)
    d0, d1, d2, d3 = d[0], d[1], d[2], d[3]
    c0, c1, c2, c3 = c[0], c[1], c[2], c[3]
    for i in range(out.shape[0]):
        m = mean[i]
        acc = zero if first else out[i]
        acc = acc + c0 * (u0[i] - d0 * m)
        acc = acc + c1 * (u1[i] - d1 * m)
        acc = acc + c2 * (u2[i] - d2 * m)
        out[i] = acc + c3 * (u3[i] - d3 * m)


@numba.njit(cache=True, nogil=True)
def _add1(out: np.ndarray, mean: np.ndarray, u0: np.ndarray, d0: np.float32, c0: np.float32, first: bool) -> None:
    """out (+0.0 if `first`) += c0·(u0 − d0·mean), per element."""
    zero = np.float32(0.0)
    for i in range(out.shape[0]):
        m = mean[i]
        acc = zero if first else out[i]
        out[i] = acc + c0 * (u0[i] - d0 * m)


@numba.njit(cache=True, nogil=True)
def _tangent_span(out: np.ndarray, mean: np.ndarray, units: tuple, picks: np.ndarray, dots: np.ndarray,
                  coefs: np.ndarray, count: int, with_mean: bool, s: int, e: int) -> None:
    """`karcher_tangent` on elements [s, e), a tile at a time (zero-based slices, so that the loops vectorize)."""
    zeros = np.zeros(_TILE, np.float32)
    for t0 in range(s, e, _TILE):
        t1 = min(t0 + _TILE, e)
        o = out[t0:t1]
        m = mean[t0:t1] if with_mean else zeros[:t1 - t0]
        if count == 0:
            o[:] = np.float32(0.0)
        j = 0
        while count - j >= 8:
            p = picks[j:j + 8]
            _add8(o, m, units[p[0]][t0:t1], units[p[1]][t0:t1], units[p[2]][t0:t1], units[p[3]][t0:t1],
                  units[p[4]][t0:t1], units[p[5]][t0:t1], units[p[6]][t0:t1], units[p[7]][t0:t1], dots[j:j + 8],
                  coefs[j:j + 8], j == 0)
            j += 8
        if count - j >= 4:
            p = picks[j:j + 4]
            _add4(o, m, units[p[0]][t0:t1], units[p[1]][t0:t1], units[p[2]][t0:t1], units[p[3]][t0:t1],
                  dots[j:j + 4], coefs[j:j + 4], j == 0)
            j += 4
        while j < count:
            _add1(o, m, units[picks[j]][t0:t1], dots[j], coefs[j], j == 0)
            j += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def karcher_tangent(out: np.ndarray, mean: np.ndarray, units: tuple, picks: np.ndarray, dots: np.ndarray,
                    coefs: np.ndarray, count: int, with_mean: bool) -> None:
    """out = Σ_j coefs[j]·(units[picks[j]] − dots[j]·mean) for j < count, in j order from +0.0: torch's
    ``tangent += c * (u - dot * mean)`` from zeros, with 0-d float32 ``c`` and ``dot``. Without `with_mean`,
    ``mean`` is not read and out = Σ_j coefs[j]·units[picks[j]] (``u − d·(+0.0)`` is u exactly, for d = 0):
    the loop's start ``mean += a * u``."""
    n = out.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        _tangent_span(out, mean, units, picks, dots, coefs, count, with_mean, s, e)


@numba.njit(cache=True, nogil=True, parallel=True)
def karcher_step(mean: np.ndarray, tangent: np.ndarray, cos_tn: np.float32, sin_tn: np.float32,
                 tn: np.float32) -> None:
    """mean = cos_tn·mean + sin_tn·(tangent / tn), in place: torch's
    ``torch.cos(tn) * mean + torch.sin(tn) * (tangent / tn)`` with 0-d float32 ``tn``."""
    n = mean.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        m, g = mean[s:e], tangent[s:e]
        for i in range(m.shape[0]):
            m[i] = cos_tn * m[i] + sin_tn * (g[i] / tn)


@numba.njit(cache=True, nogil=True, parallel=True)
def divide(out: np.ndarray, x: np.ndarray, d: np.float32) -> None:
    """out = x / d (float32; `out` and `x` do not overlap): torch's ``torch.div(x, d)`` with 0-d float32 ``d``."""
    n = x.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        o, v = out[s:e], x[s:e]
        for i in range(v.shape[0]):
            o[i] = v[i] / d


@numba.njit(cache=True, nogil=True, parallel=True)
def in_place(x: np.ndarray, f: np.float32, divide: bool) -> None:
    """x = x / f (`divide`: torch's ``x.div_(f)``) or x = x·f (``x.mul_(f)``) in place, float32, ``f`` a 0-d
    float32 (one array: where `divide`'s two overlap, LLVM's run-time alias check takes its scalar loop)."""
    n = x.shape[0]
    c = n_chunks(n, PAR_CHUNK)
    for t in numba.prange(c):
        s, e = chunk_span(n, c, t)
        v = x[s:e]
        if divide:
            for i in range(v.shape[0]):
                v[i] = v[i] / f
        else:
            for i in range(v.shape[0]):
                v[i] = v[i] * f
