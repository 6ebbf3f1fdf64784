"""Row-block geometry shared by ingest, planner and executor (docs/SEMANTICS.md, "Blocks")."""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_BLOCK_BYTES = 1 << 20


def row_count(shape: Sequence[int]) -> int:
    """Rows along dim 0; a 0-d tensor has one row."""
    return int(shape[0]) if len(shape) >= 1 else 1


def rows_per_block(shape: Sequence[int], itemsize_bits: int, block_bytes: int) -> int:
    """Rows in each block: as many whole rows as fit in `block_bytes` (at least one).

    A 0-d or 1-d tensor, or one whose rows are not whole bytes, is a single block.
    """
    n_rows = row_count(shape)
    if len(shape) <= 1:
        return max(1, n_rows)
    row_bits = math.prod(shape[1:]) * itemsize_bits
    if row_bits == 0 or row_bits % 8:
        return max(1, n_rows)
    return max(1, block_bytes // (row_bits // 8))


def row_bytes(shape: Sequence[int], itemsize_bits: int) -> int:
    """Bytes of one row along dim 0 (the whole tensor for 0-d/1-d)."""
    if len(shape) <= 1:
        return (math.prod(shape) * itemsize_bits) // 8
    return (math.prod(shape[1:]) * itemsize_bits) // 8


def block_ranges(shape: Sequence[int], rpb: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of each block, in order."""
    n_rows = row_count(shape)
    if len(shape) <= 1:
        return [(0, n_rows)]
    if n_rows == 0:
        return [(0, 0)]
    return [(start, min(n_rows, start + rpb)) for start in range(0, n_rows, rpb)]


def block_byte_range(shape: Sequence[int], itemsize_bits: int, rows: tuple[int, int]) -> tuple[int, int]:
    """(relative byte offset, byte length) of a row range within the tensor's bytes."""
    if len(shape) <= 1:
        return 0, (math.prod(shape) * itemsize_bits) // 8
    rb = row_bytes(shape, itemsize_bits)
    return rows[0] * rb, (rows[1] - rows[0]) * rb
