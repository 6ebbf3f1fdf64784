"""Packed block store: an expert's delta blocks, zstd-compressed, content-addressed, append-only.

A packed block's payload is ``zstd(expert_bytes XOR base_bytes)`` (frame checksum on): exact for any dtype,
and small because fine-tuned weights share most bytes (sign, exponent, high mantissa) with the base.
Payloads are addressed by the xxh3_128 of the uncompressed XOR bytes; an identical payload is stored once.
Store files (``<store>/blocks.mpstore``) are only ever appended to, under a file lock, and fsynced before
the catalog transaction that references them; a crash in between leaves unreferenced tail bytes, nothing
else. The planner's cost of a packed block is its compressed length and the executor reads exactly that
many bytes from the store (`PackedIndex.read`), then XORs with the base block it already holds.
Only blocks that can be candidates (Δ ≠ 0) are packed, and only where the payload is smaller than the block
(a dense float32 change can leave the low mantissa bytes incompressible): a packed block never costs more to
read than the raw one, so a budget of 1.0 (the raw full read) still reads every candidate. Payloads a pack of an
earlier version stored that are not smaller are ignored (`load_index`). Whole-tensor reads (slerp, tensors
without statistics) still read the expert's own file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.db import schema
from mergepipe_db.errors import IntegrityError, PackError, StaleSourceError, UnknownCheckpointError

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


@dataclass(frozen=True)
class PackResult:
    expert: str
    store: str
    blocks_packed: int
    blocks_deduplicated: int
    raw_bytes: int  # uncompressed bytes of the packed blocks
    stored_bytes: int  # compressed bytes appended to the store by this call
    packed_bytes: int  # compressed bytes the packed blocks cost to read (dedup included)
    blocks_left_raw: int = 0  # candidates whose payload would not be smaller: read from the expert's file

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.packed_bytes if self.packed_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": self.ratio}


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

        from mergepipe_db.executor import _verify, coalesce
        from mergepipe_db.storage import xxh3_hex

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
                _verify(view, et, members, expert)
        return buf, n_read


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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


def default_store(db: Any) -> Path:
    """``<catalog dir>/mergepipe-store`` for a DuckDB catalog, else ``./mergepipe-store``."""
    p = db.duckdb_path
    if p is not None and str(p) != ":memory:":
        return Path(p).resolve().parent / "mergepipe-store"
    return Path.cwd() / "mergepipe-store"


def pack(db: Any, name: str, *, store: str | Path | None = None) -> PackResult:
    """Pack the candidate blocks (Δ ≠ 0) of full expert `name` into the store. Idempotent.

    Raises UnknownCheckpointError, PackError (not a full expert of a base), StaleSourceError (a source
    changed since ingest). The catalog changes in one transaction after the store file is fsynced."""
    import numpy as np
    import zstandard
    from filelock import FileLock

    from mergepipe_db.storage import RangeReader, fsync_dir, xxh3_hex

    c, b = schema.checkpoint, schema.block
    with db.connect() as conn:
        row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
        if row is None:
            raise UnknownCheckpointError(f"unknown checkpoint {name!r}")
        if row["kind"] != "full" or row["base_id"] is None:
            raise PackError(f"{name!r} is a {row['kind']} checkpoint{'' if row['base_id'] else ' without a base'}; "
                            f"only full experts ingested with --base can be packed")
        from mergepipe_db.planner import load_tensors

        mine = {x.idx: x for x in load_tensors(conn, row["id"])}
        base = {x.name: x for x in load_tensors(conn, row["base_id"])}
        blocks = conn.execute(
            sa.select(b.c.tensor_idx, b.c.block_idx, b.c.offset, b.c.nbytes, b.c.xxh3)
            .where(b.c.checkpoint_id == row["id"], b.c.delta_l2.is_(None) | (b.c.delta_l2 != 0))
            .order_by(b.c.tensor_idx, b.c.block_idx)).all()
        done = {(int(r[0]), int(r[1])) for r in conn.execute(
            sa.select(schema.packed_block.c.tensor_idx, schema.packed_block.c.block_idx)
            .where(schema.packed_block.c.checkpoint_id == row["id"]))}
        known = {h: (int(cl)) for h, cl in conn.execute(sa.select(schema.blob.c.hash, schema.blob.c.clen))}
        base_hashes = {(int(ti), int(bi)): h for ti, bi, h in conn.execute(
            sa.select(b.c.tensor_idx, b.c.block_idx, b.c.xxh3).where(b.c.checkpoint_id == row["base_id"]))}
    store_dir = Path(store) if store is not None else default_store(db)
    store_dir.mkdir(parents=True, exist_ok=True)
    store_path = (store_dir / STORE_FILE).resolve()
    cctx = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True)
    new_blobs: list[dict[str, Any]] = []
    new_packed: list[dict[str, Any]] = []
    raw_total = stored = packed_cost = dedup = left_raw = 0
    with FileLock(str(store_path) + ".lock"), RangeReader(random=False) as reader:
        fd = os.open(store_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            pos = os.fstat(fd).st_size
            for tidx, bidx, off, nbytes, h in blocks:
                key = (int(tidx), int(bidx))
                et = mine[key[0]]
                if key in done or et.dtype not in ("F32", "F16", "BF16") or key[1] < 0:
                    continue
                bt = base[et.name]
                rel = int(off) - et.offset
                data = reader.read(et.path, int(off), int(nbytes))
                if xxh3_hex(data) != h:
                    raise StaleSourceError(f"{et.path}: block {bidx} of {et.name!r} changed since ingest; "
                                           f"re-ingest {name!r} before packing")
                bdata = reader.read(bt.path, bt.offset + rel, int(nbytes))
                x = np.bitwise_xor(np.frombuffer(data, np.uint8), np.frombuffer(bdata, np.uint8)).tobytes()
                ph = xxh3_hex(x)
                if ph in known:
                    clen = known[ph]
                    if clen >= len(x):  # stored by an earlier version: not read (`load_index`)
                        left_raw += 1
                        continue
                    dedup += 1
                else:
                    payload = cctx.compress(x)
                    if len(payload) >= len(x):  # no smaller than the block: left to be read from the file
                        left_raw += 1
                        continue
                    _write_all(fd, payload)
                    clen = len(payload)
                    new_blobs.append({"hash": ph, "store_path": str(store_path), "offset": pos, "clen": clen,
                                      "raw_len": len(x), "codec": CODEC})
                    known[ph] = clen
                    pos += clen
                    stored += clen
                new_packed.append({"checkpoint_id": row["id"], "tensor_idx": key[0], "block_idx": key[1],
                                   "blob_hash": ph, "clen": clen, "base_xxh3": base_hashes.get(
                                       (bt.idx, key[1]), xxh3_hex(bdata))})
                raw_total += len(x)
                packed_cost += clen
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(store_dir)
        from mergepipe_db.db.bulk import bulk_insert

        with db.connect() as conn:
            bulk_insert(conn, schema.blob, new_blobs)
            bulk_insert(conn, schema.packed_block, new_packed)
    return PackResult(name, str(store_path), len(new_packed), dedup, raw_total, stored, packed_cost, left_raw)
