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
        i32 = ir.IntType(32)
        f32 = ir.FloatType()
        v16 = ir.VectorType(i32, _LANES)
        f16 = ir.VectorType(f32, _LANES)
        m16 = ir.VectorType(ir.IntType(1), _LANES)

        def ptr(ty, value, offset):
            data = context.make_array(ty)(context, builder, value).data
            return builder.gep(data, [offset])

        vec = builder.load(builder.bitcast(ptr(src_t, src_v, j_v), v16.as_pointer()), align=4)
        nonzero = builder.icmp_unsigned("!=", vec, ir.Constant(v16, [0] * _LANES))
        zero = builder.not_(nonzero)
        first = builder.insert_element(ir.Constant(v16, ir.Undefined), builder.trunc(j_v, i32), ir.Constant(i32, 0))
        splat = builder.shuffle_vector(first, ir.Constant(v16, ir.Undefined), ir.Constant(v16, [0] * _LANES))
        lanes = builder.add(splat, ir.Constant(v16, list(range(_LANES))))
        compress = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, m16, v16]),
                                                  "llvm.experimental.vector.compress.v16i32")
        undef = ir.Constant(v16, ir.Undefined)
        builder.store(builder.call(compress, [vec, nonzero, undef]),
                      builder.bitcast(ptr(keys_t, keys_v, m_v), v16.as_pointer()), align=4)
        builder.store(builder.call(compress, [lanes, nonzero, undef]),
                      builder.bitcast(ptr(idx_t, idx_v, m_v), v16.as_pointer()), align=4)
        expand = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f16, [f32.as_pointer(), m16, f16]), "llvm.masked.expandload.v16f32")
        ranks = builder.call(expand, [ptr(table_t, table_v, z_v), zero, ir.Constant(f16, ir.Undefined)])
        builder.store(ranks, builder.bitcast(ptr(out_t, out_v, j_v), f16.as_pointer()), align=4)
        i16 = ir.IntType(16)
        popcount = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        return builder.zext(builder.call(popcount, [builder.bitcast(nonzero, i16)]), ir.IntType(64))

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
        i32 = ir.IntType(32)
        v16 = ir.VectorType(i32, _LANES)
        m16 = ir.VectorType(ir.IntType(1), _LANES)

        def ptr(ty, value, offset):
            data = context.make_array(ty)(context, builder, value).data
            return builder.gep(data, [offset])

        def splat(value):
            first = builder.insert_element(ir.Constant(v16, ir.Undefined), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(first, ir.Constant(v16, ir.Undefined), ir.Constant(v16, [0] * _LANES))

        vec = builder.load(builder.bitcast(ptr(src_t, src_v, j_v), v16.as_pointer()), align=4)
        inside = builder.and_(builder.icmp_unsigned(">", vec, splat(lo_v)),
                              builder.icmp_unsigned("<", vec, splat(hi_v)))
        compress = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, m16, v16]),
                                                  "llvm.experimental.vector.compress.v16i32")
        builder.store(builder.call(compress, [vec, inside, ir.Constant(v16, ir.Undefined)]),
                      builder.bitcast(ptr(out_t, out_v, m_v), v16.as_pointer()), align=4)
        i16 = ir.IntType(16)
        popcount = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16]), "llvm.ctpop.i16")
        return builder.zext(builder.call(popcount, [builder.bitcast(inside, i16)]), ir.IntType(64))

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
