"""Bit reinterpretation inside numba kernels: float32/float64 <-> unsigned integers, and BF16 widening.

A register-level bitcast (no one-element array views, which block vectorization and cost a store and a
load per element). Used by the ingest statistics kernels (`kernels/block_stats.py`) and the merge kernels
(`kernels/merge.py`).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic, overload


def _bitcast(src: types.Type, dst: types.Type):  # noqa: ANN202 - builds a numba intrinsic
    @intrinsic
    def cast(typingctx, x):  # noqa: ANN001, ANN202
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    return cast


bits_to_f32 = _bitcast(types.uint32, types.float32)
f32_to_bits = _bitcast(types.float32, types.uint32)
f64_to_bits = _bitcast(types.float64, types.uint64)


def widen(x):  # noqa: ANN001, ANN201 - a stored value as float32 (compiled by the overload below)
    raise NotImplementedError("widen is only callable from numba-compiled code")


@overload(widen, inline="always")
def _widen(x):  # noqa: ANN001, ANN202
    if x == types.uint16:  # BF16 bits: widening is exact, the bits shifted left 16
        return lambda x: bits_to_f32(np.uint32(x) << np.uint32(16))
    return lambda x: np.float32(x)
