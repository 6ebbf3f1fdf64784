"""Pack: compress a full expert's changed blocks (Δ against the base, zstd per block) into a block store, so a
merge reads each packed block's compressed length instead of its raw bytes (`sources.packed` reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.db import schema
from mergepipe_db.errors import PackError, StaleSourceError, UnknownCheckpointError
from mergepipe_db.sources.packed import CODEC, LEVEL, STORE_FILE


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

    from mergepipe_db.core.hashing import xxh3_hex
    from mergepipe_db.io import open_store
    from mergepipe_db.sources import source_class

    c, b = schema.checkpoint, schema.block
    with db.connect() as conn:
        row = conn.execute(sa.select(c).where(c.c.name == name)).mappings().first()
        if row is None:
            raise UnknownCheckpointError(f"unknown checkpoint {name!r}")
        if not source_class(row["kind"]).packable or row["base_id"] is None:
            raise PackError(f"{name!r} is a {row['kind']} checkpoint{'' if row['base_id'] else ' without a base'}; "
                            f"only full experts ingested with --base can be packed")
        from mergepipe_db.db.checkpoints import load_tensors

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
    bytes_store = open_store(store_path)
    with FileLock(str(store_path) + ".lock"), bytes_store.range_reader(random=False) as reader:
        out = bytes_store.appender(store_path)
        try:
            pos = out.size
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
                    out.write(memoryview(payload))
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
            out.finish(fsync=True)
        except BaseException:
            out.abort()
            raise
        bytes_store.sync(store_dir)
        from mergepipe_db.db.bulk import bulk_insert

        with db.connect() as conn:
            bulk_insert(conn, schema.blob, new_blobs)
            bulk_insert(conn, schema.packed_block, new_packed)
    return PackResult(name, str(store_path), len(new_packed), dedup, raw_total, stored, packed_cost, left_raw)
