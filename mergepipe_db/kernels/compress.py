"""Packing the selected lanes of an array of keys, 16 lanes at a time: splitting keys into their nonzero and
zero ones (`split_nonzero_ranks`), and keeping those strictly between two bounds (`pack_between`).

A packing loop written element by element (``keys[m] = k; m += k != 0``) does not vectorize: its store address
depends on the count so far. LLVM's generic ``llvm.experimental.vector.compress`` packs the selected lanes of a
vector to its front (one ``vpcompressd`` on AVX-512; a portable expansion elsewhere); the packed vector is then
stored whole, so each output array needs `SLACK` elements past its end, which later stores overwrite. The
generic ``llvm.masked.expandload`` does the opposite for the zero keys: consecutive table entries into their
lanes (one ``vexpandps``).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["SLACK", "pack_between", "split_nonzero_ranks"]

_LANES = 16
SLACK = _LANES  #: elements an output holds past the last key kept (`split_nonzero_ranks`, `pack_between`)


_I32 = ir.IntType(32)
_V16 = ir.VectorType(_I32, _LANES)  # 16 uint32 keys
_M16 = ir.VectorType(ir.IntType(1), _LANES)  # a lane mask


def _element(context, builder, ty, value, offset):  # noqa: ANN001, ANN202
    """A pointer to element `offset` of the contiguous array argument `value` (numba type `ty`)."""
    return builder.gep(context.make_array(ty)(context, builder, value).data, [offset])


def _splat(builder, value):  # noqa: ANN001, ANN202
    """An i32 `value` in all 16 lanes."""
    first = builder.insert_element(ir.Constant(_V16, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, ir.Constant(_V16, ir.Undefined), ir.Constant(_V16, [0] * _LANES))


def _compress_store(builder, vec, mask, pointer) -> None:  # noqa: ANN001
    """The lanes of `vec` selected by `mask` packed to the front and stored whole (16 lanes) at `pointer`."""
    compress = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _M16, _V16]),
                                              "llvm.experimental.vector.compress.v16i32")
    builder.store(builder.call(compress, [vec, mask, ir.Constant(_V16, ir.Undefined)]),
                  builder.bitcast(pointer, _V16.as_pointer()), align=4)


def _count(builder, mask):  # noqa: ANN001, ANN202
    """How many lanes `mask` selects, as an int64."""
    i16 = ir.IntType(16)
    popcount = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
    return builder.zext(builder.call(popcount, [builder.bitcast(mask, i16)]), ir.IntType(64))


@intrinsic
def _split16_zero_ranks(typingctx, src, j, keys, idx, m, table, z, out):  # noqa: ANN001, ANN202, ARG001
    """src[j : j + 16] (uint32): the nonzero keys packed at keys[m:] and their indices at idx[m:] (each as a
    whole 16-lane store; contiguous arrays), and the zero keys' lanes of out[j : j + 16] given table[z],
    table[z + 1], ... in lane order (a masked expanding load; the other lanes unspecified). Returns how many
    were nonzero."""
    sig = types.int64(src, j, keys, idx, m, table, z, out)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        src_v, j_v, keys_v, idx_v, m_v, table_v, z_v, out_v = args
        src_t, _, keys_t, idx_t, _, table_t, _, out_t = signature.args
        f32 = ir.FloatType()
        f16 = ir.VectorType(f32, _LANES)
        vec = builder.load(builder.bitcast(_element(context, builder, src_t, src_v, j_v), _V16.as_pointer()),
                           align=4)
        nonzero = builder.icmp_unsigned("!=", vec, ir.Constant(_V16, [0] * _LANES))
        lanes = builder.add(_splat(builder, builder.trunc(j_v, _I32)), ir.Constant(_V16, list(range(_LANES))))
        _compress_store(builder, vec, nonzero, _element(context, builder, keys_t, keys_v, m_v))
        _compress_store(builder, lanes, nonzero, _element(context, builder, idx_t, idx_v, m_v))
        expand = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f16, [f32.as_pointer(), _M16, f16]), "llvm.masked.expandload.v16f32")
        ranks = builder.call(expand, [_element(context, builder, table_t, table_v, z_v), builder.not_(nonzero),
                                      ir.Constant(f16, ir.Undefined)])
        builder.store(ranks, builder.bitcast(_element(context, builder, out_t, out_v, j_v), f16.as_pointer()),
                      align=4)
        return _count(builder, nonzero)

    return sig, codegen


@numba.njit(nogil=True, inline="always")
def split_nonzero_ranks(src: np.ndarray, n: int, keys: np.ndarray, idx: np.ndarray, table: np.ndarray,
                        out: np.ndarray) -> tuple[int, int]:
    """(m, z): the m nonzero keys of src[:n] (uint32, contiguous) into keys[:m] and their indices into idx[:m]
    (uint32), in index order (both hold n + `SLACK`), and out[j] = table[r] for the r-th zero key src[j] (r
    from 0, index order; `out`: n float32, contiguous; a nonzero key's element gets an unspecified value)."""
    m = 0
    z = 0
    j = 0
    while j + _LANES <= n:
        c = _split16_zero_ranks(src, j, keys, idx, m, table, z, out)
        m += c
        z += _LANES - c
        j += _LANES
    while j < n:
        k = src[j]
        if k != np.uint32(0):
            keys[m] = k
            idx[m] = j
            m += 1
        else:
            out[j] = table[z]
            z += 1
        j += 1
    return m, z


@intrinsic
def _pack16_between(typingctx, src, j, lo, hi, out, m):  # noqa: ANN001, ANN202, ARG001
    """The keys lo < src[i] < hi (unsigned) of src[j : j + 16] packed at out[m:] (a whole 16-lane store;
    contiguous uint32 arrays). Returns how many."""
    sig = types.int64(src, j, lo, hi, out, m)

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        src_v, j_v, lo_v, hi_v, out_v, m_v = args
        src_t, _, _, _, out_t, _ = signature.args
        vec = builder.load(builder.bitcast(_element(context, builder, src_t, src_v, j_v), _V16.as_pointer()),
                           align=4)
        inside = builder.and_(builder.icmp_unsigned(">", vec, _splat(builder, lo_v)),
                              builder.icmp_unsigned("<", vec, _splat(builder, hi_v)))
        _compress_store(builder, vec, inside, _element(context, builder, out_t, out_v, m_v))
        return _count(builder, inside)

    return sig, codegen


@numba.njit(nogil=True, inline="always")
def pack_between(src: np.ndarray, n: int, lo: np.uint32, hi: np.uint32, out: np.ndarray, m: int) -> int:
    """The keys lo < k < hi of src[:n] (uint32, contiguous), in index order, into out[m:] (uint32, contiguous,
    holding `SLACK` elements past the last one kept); returns how many."""
    c = 0
    j = 0
    while j + _LANES <= n:
        c += _pack16_between(src, j, lo, hi, out, m + c)
        j += _LANES
    while j < n:
        k = src[j]
        if lo < k < hi:
            out[m + c] = k
            c += 1
        j += 1
    return c
