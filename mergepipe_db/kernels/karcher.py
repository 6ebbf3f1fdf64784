"""The element-wise steps of karcher's float32 loop (`operators.geometric.karcher_float32`), fused (numba).

Each kernel does, per element, exactly the float32 operations of the torch formulas it replaces, in the same
order (numba compiles without fast-math: nothing is reassociated or contracted into FMAs), so the results are
identical bit for bit; the reductions (dots, norms) stay with torch. The tangent sum takes up to eight inputs
in one pass over the elements, so each unit vector is read once an iteration and the sum is written once or twice.
``units`` is a tuple of flat float32 arrays of one length (`merge.pack`: padded to a power of two, so that
a kernel is compiled once per padded length). Serial, and they release the GIL.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["karcher_step", "karcher_tangent"]



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
        acc = zero if first else out[i]
        out[i] = acc + c0 * (u0[i] - d0 * mean[i])


@numba.njit(cache=True, nogil=True)
def karcher_tangent(out: np.ndarray, mean: np.ndarray, units: tuple, picks: np.ndarray, dots: np.ndarray,
                    coefs: np.ndarray, count: int) -> None:
    """out = Σ_j coefs[j]·(units[picks[j]] − dots[j]·mean) for j < count, in j order from +0.0: torch's
    ``tangent += c * (u - dot * mean)`` from zeros, with 0-d float32 ``c`` and ``dot``. Up to eight inputs a
    pass (the loop unrolled over them, so that it vectorizes and every array streams through once)."""
    if count == 0:
        out[:] = np.float32(0.0)
    j = 0
    while count - j >= 8:
        p = picks[j:j + 8]
        _add8(out, mean, units[p[0]], units[p[1]], units[p[2]], units[p[3]], units[p[4]], units[p[5]],
              units[p[6]], units[p[7]], dots[j:j + 8], coefs[j:j + 8], j == 0)
        j += 8
    if count - j >= 4:
        p = picks[j:j + 4]
        _add4(out, mean, units[p[0]], units[p[1]], units[p[2]], units[p[3]], dots[j:j + 4], coefs[j:j + 4], j == 0)
        j += 4
    while j < count:
        _add1(out, mean, units[picks[j]], dots[j], coefs[j], j == 0)
        j += 1


@numba.njit(cache=True, nogil=True)
def karcher_step(mean: np.ndarray, tangent: np.ndarray, cos_tn: np.float32, sin_tn: np.float32,
                 tn: np.float32) -> None:
    """mean = cos_tn·mean + sin_tn·(tangent / tn), in place: torch's
    ``torch.cos(tn) * mean + torch.sin(tn) * (tangent / tn)`` with 0-d float32 ``tn``."""
    for i in range(mean.shape[0]):
        mean[i] = cos_tn * mean[i] + sin_tn * (tangent[i] / tn)
