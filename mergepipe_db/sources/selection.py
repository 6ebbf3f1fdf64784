"""Reading a selection of a stored tensor: which rows the selected blocks cover, coalescing byte-adjacent reads
into one request, and checking each block's xxh3 against the catalog (`--verify-reads`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mergepipe_db.core.geometry import block_ranges
from mergepipe_db.core.hashing import xxh3_hex
from mergepipe_db.core.plan import Read, TensorInfo
from mergepipe_db.errors import IntegrityError
from mergepipe_db.io import RangeSource
from mergepipe_db.io import coalesce as coalesce_ranges
from mergepipe_db.io.buffers import BufferPool


def coalesce(reads: tuple[Read, ...]) -> list[tuple[int, int, list[Read]]]:
    """Group byte-adjacent reads into single ranges: [(offset, nbytes, reads)] (`io.coalesce`)."""
    return list(coalesce_ranges(reads))


def read_selected(reader: RangeSource, et: TensorInfo, reads: tuple[Read, ...], expert: str, verify: bool
                  ) -> tuple[Any, int]:
    """The tensor's bytes (a uint8 array) with only the selected ranges read (adjacent ones
    coalesced; the other bytes are undefined), and the bytes read."""
    buf, n_read, _arr = read_selected_into(reader, et, reads, expert, verify, None)
    return buf, n_read


def read_selected_into(reader: RangeSource, et: TensorInfo, reads: tuple[Read, ...], expert: str, verify: bool,
                   pool: BufferPool | None) -> tuple[np.ndarray, int, np.ndarray | None]:
    arr, pos = (pool or BufferPool()).take(et.offset, et.nbytes)  # no pool: a fresh buffer
    view = memoryview(arr[pos:pos + et.nbytes])
    n_read = 0
    runs = coalesce(reads)
    many = getattr(reader, "read_aligned_many", None)
    if many is not None and len(runs) > 1:  # a store that serves them all at once (S3: requests in flight)
        many(et.path, [(off, arr, pos + off - et.offset, n) for off, n, _m in runs])
    for off, n, members in runs:
        if many is None or len(runs) == 1:
            reader.read_aligned(et.path, off, arr, pos + off - et.offset, n)
        n_read += n
        if verify:
            verify_members(view, et, members, expert)
    return arr[pos:pos + et.nbytes], n_read, (arr if pool is not None else None)


def verify_members(view: memoryview, et: TensorInfo, members: list[Read], expert: str) -> None:
    for r in members:
        rel = r.offset - et.offset
        got = xxh3_hex(view[rel:rel + r.nbytes])
        if got != r.xxh3:
            what = "whole tensor" if r.block_idx < 0 else f"block {r.block_idx}"
            raise IntegrityError(
                f"corrupted read in expert {expert!r}, file {et.path}, tensor {et.name!r}, {what}: "
                f"xxh3 {got} != catalog {r.xxh3}")


def selected_rows(et: TensorInfo, reads: tuple[Read, ...]) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    ranges = block_ranges(et.shape, et.rows_per_block)
    if any(r.block_idx < 0 for r in reads):
        blocks = tuple(range(len(ranges)))
    else:
        blocks = tuple(r.block_idx for r in reads)
    rows: list[tuple[int, int]] = []
    for b in blocks:
        start, stop = ranges[b]
        if rows and rows[-1][1] == start:
            rows[-1] = (rows[-1][0], stop)
        else:
            rows.append((start, stop))
    return blocks, rows
