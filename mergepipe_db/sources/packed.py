"""Packed block store: an expert's delta blocks, zstd-compressed, content-addressed, append-only.

A packed block's payload is ``zstd(expert_bytes XOR base_bytes)`` (frame checksum on): exact for any dtype,
and small because fine-tuned weights share most bytes (sign, exponent, high mantissa) with the base.
Payloads are addressed by the xxh3_128 of the uncompressed XOR bytes; an identical payload is stored once.
Store files (``<store>/blocks.mpstore``) are only ever appended to, under a file lock, and fsynced before
the catalog transaction that references them; a crash in between leaves unreferenced tail bytes, nothing
else. The planner's cost of a packed block is its compressed length and the executor reads exactly that
many bytes from the store (`PackedIndex.read`), then XORs with the base block it already holds.
`PackedSource` is the expert source of a full expert with packed blocks (`sources.source_for` picks it).
Only blocks that can be candidates (Δ ≠ 0) are packed, and only where the payload is smaller than the block
(a dense float32 change can leave the low mantissa bytes incompressible): a packed block never costs more to
read than the raw one, so a budget of 1.0 (the raw full read) still reads every candidate. Payloads a pack of an
earlier version stored that are not smaller are ignored (`load_index`). Whole-tensor reads (slerp, tensors
without statistics) still read the expert's own file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import sqlalchemy as sa

from mergepipe_db.core.plan import CheckpointInfo, Read, TensorInfo
from mergepipe_db.db import schema
from mergepipe_db.errors import IntegrityError
from mergepipe_db.sources.base import THETA, SourceRead
from mergepipe_db.sources.full import FullSource

CODEC = "zstd-xor"
STORE_FILE = "blocks.mpstore"
LEVEL = 3


@dataclass(frozen=True)
class PackedBlock:
    store_path: str
    offset: int
    clen: int
    raw_len: int
    base_xxh3: str


class PackedIndex:
    """The packed blocks of one expert: (expert tensor_idx, block_idx) -> PackedBlock."""

    def __init__(self, blocks: dict[tuple[int, int], PackedBlock]) -> None:
        self.blocks = blocks

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def cost(self, tensor_idx: int, read: Any) -> int:
        """Read cost (bytes) of a planned unit: the compressed length when packed."""
        pb = self.blocks.get((tensor_idx, read.block_idx)) if read.block_idx >= 0 else None
        return read.nbytes if pb is None else pb.clen

    def read(self, et: Any, t: Any, reads: tuple[Any, ...], base: Any, reader: Any, verify: bool,
             expert: str) -> tuple[Any, int]:
        """The expert tensor's bytes (uint8, planned blocks filled) and the bytes read (compressed for
        packed blocks). `base` holds the base tensor's bytes (same dtype and layout: a full checkpoint)."""
        import numpy as np
        import zstandard

        from mergepipe_db.core.hashing import xxh3_hex
        from mergepipe_db.sources.selection import coalesce, verify_members

        buf = np.empty(et.nbytes, dtype=np.uint8)
        view = memoryview(buf)
        out = buf
        base_np = base
        n_read = 0
        plain = []
        dctx = zstandard.ZstdDecompressor()
        for r in reads:
            pb = self.blocks.get((et.idx, r.block_idx)) if r.block_idx >= 0 else None
            if pb is None:
                plain.append(r)
                continue
            payload = reader.read(pb.store_path, pb.offset, pb.clen)
            n_read += pb.clen
            try:
                raw = dctx.decompress(bytes(payload), max_output_size=pb.raw_len)
            except zstandard.ZstdError as e:
                raise IntegrityError(f"corrupted packed block {r.block_idx} of {et.name!r} in expert {expert!r} "
                                     f"({pb.store_path} @ {pb.offset}): {e}") from e
            rel = r.offset - et.offset
            if len(raw) != pb.raw_len or rel + pb.raw_len > len(base_np):
                raise IntegrityError(f"packed block {r.block_idx} of {et.name!r} in expert {expert!r} has "
                                     f"{len(raw)} bytes, catalog says {pb.raw_len}")
            np.bitwise_xor(np.frombuffer(raw, dtype=np.uint8), base_np[rel:rel + pb.raw_len],
                           out=out[rel:rel + pb.raw_len])
            if verify and xxh3_hex(view[rel:rel + pb.raw_len]) != r.xxh3:
                raise IntegrityError(f"packed block {r.block_idx} of {et.name!r} in expert {expert!r} does not "
                                     f"rebuild the catalogued bytes (xxh3 mismatch)")
        for off, n, members in coalesce(tuple(plain)):
            rel = off - et.offset
            reader.read_into(et.path, off, view[rel:rel + n])
            n_read += n
            if verify:
                verify_members(view, et, members, expert)
        return buf, n_read


class PackedSource(FullSource):
    """A full expert with blocks in the packed store: a packed block costs, and is read as, its compressed
    payload (rebuilt against the base's bytes); the other units are read from the expert's file."""

    adjusts_reads: ClassVar[bool] = True

    def __init__(self, info: CheckpointInfo, index: PackedIndex) -> None:
        super().__init__(info)
        self.index = index

    def planned(self, et: TensorInfo, reads: tuple[Read, ...]) -> tuple[Read, ...]:
        """The reads with each packed block's cost (`nbytes`) its compressed length."""
        cost = self.index.cost
        new = tuple(replace(r, nbytes=cost(et.idx, r)) for r in reads)
        return reads if new == reads else new

    def read(self, t: TensorInfo, et: TensorInfo, reads: tuple[Read, ...], base: Any, reader: Any,
             verify: bool, pool: Any) -> SourceRead:
        """θ bytes (uint8, planned blocks filled); the bytes read count packed blocks compressed."""
        from mergepipe_db.sources.selection import selected_rows

        buf, n = self.index.read(et, t, reads, base, reader, verify, self.info.name)
        blocks, rows = selected_rows(et, reads)
        return SourceRead(THETA, buf, rows, blocks, n)


def packed_checkpoints(conn: sa.Connection, checkpoint_ids: list[str]) -> set[str]:
    """Those of `checkpoint_ids` with blocks in the store (one query)."""
    if not checkpoint_ids:
        return set()
    pk = schema.packed_block
    return set(conn.execute(sa.select(pk.c.checkpoint_id).where(pk.c.checkpoint_id.in_(sorted(set(checkpoint_ids))))
                            .distinct()).scalars())


def load_index(conn: sa.Connection, checkpoint_id: str) -> PackedIndex:
    """The packed blocks of an expert read from the store: those whose payload is smaller than the block, the
    condition sql/plan_candidates.sql costs them by (the others cost, and are read as, the raw block)."""
    pk, bl, b = schema.packed_block, schema.blob, schema.block
    rows = conn.execute(
        sa.select(pk.c.tensor_idx, pk.c.block_idx, bl.c.store_path, bl.c.offset, bl.c.clen, bl.c.raw_len,
                  pk.c.base_xxh3)
        .join(bl, bl.c.hash == pk.c.blob_hash)
        .join(b, (b.c.checkpoint_id == pk.c.checkpoint_id) & (b.c.tensor_idx == pk.c.tensor_idx)
              & (b.c.block_idx == pk.c.block_idx))
        .where(pk.c.checkpoint_id == checkpoint_id, pk.c.clen < b.c.nbytes)
    ).all()
    return PackedIndex({(int(r[0]), int(r[1])): PackedBlock(str(r[2]), int(r[3]), int(r[4]), int(r[5]), str(r[6]))
                        for r in rows})


