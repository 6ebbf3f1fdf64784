"""A checkpoint's rows in the catalog: written once (`write_checkpoint`, by ingest and by a merge's commit), read
back as core objects (`CheckpointInfo`, `TensorInfo`), and names resolved to checkpoints and snapshots
(``<ref>@<version>``)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.plan import CheckpointInfo, FileStamp, TensorInfo
from mergepipe_db.db import rank_tables, schema
from mergepipe_db.db.bulk import bulk_insert
from mergepipe_db.errors import UnknownCheckpointError


def write_checkpoint(conn: sa.Connection, checkpoint: dict[str, Any], files: Sequence[dict[str, Any]],
                     tensors: Sequence[dict[str, Any]], blocks: Sequence[dict[str, Any]]) -> None:
    """Insert one checkpoint in the caller's transaction: its mp_checkpoint row, source files, tensors and
    blocks (rows keyed by column name, each carrying the checkpoint's id), the blocks in rank order
    (`rank_tables.in_rank_order`), then its ranking summaries and tensor sketches (`rank_tables.write`)."""
    conn.execute(schema.checkpoint.insert().values(**checkpoint))
    bulk_insert(conn, schema.source_file, files)
    bulk_insert(conn, schema.tensor, tensors)
    bulk_insert(conn, schema.block, rank_tables.in_rank_order(blocks))
    rank_tables.write(conn, checkpoint["id"])


def load_checkpoint_info(conn: sa.Connection, checkpoint_id: str) -> CheckpointInfo:
    return load_checkpoint_infos(conn, [checkpoint_id])[0]


def load_checkpoint_infos(conn: sa.Connection, checkpoint_ids: list[str]) -> list[CheckpointInfo]:
    """The checkpoints `checkpoint_ids` (in that order; NoResultFound for an unknown id), two queries in all."""
    c, f = schema.checkpoint, schema.source_file
    wanted = sorted(set(checkpoint_ids))
    rows = {r["id"]: r for r in conn.execute(sa.select(c).where(c.c.id.in_(wanted))).mappings()}
    files: dict[str, list[Any]] = defaultdict(list)
    for r in conn.execute(sa.select(f).where(f.c.checkpoint_id.in_(wanted))
                          .order_by(f.c.checkpoint_id, f.c.file_idx)).mappings():
        files[r["checkpoint_id"]].append(r)
    out = []
    for cid in checkpoint_ids:
        row = rows.get(cid)
        if row is None:
            raise sa.exc.NoResultFound(f"no checkpoint {cid}")
        fs = files[cid]
        out.append(CheckpointInfo(
            id=row["id"], name=row["name"], kind=row["kind"], root=row["root"], has_stats=bool(row["has_stats"]),
            block_bytes=int(row["block_bytes"]),
            files=tuple(FileStamp(r["path"], r["size"], r["mtime_ns"]) for r in fs),
            file_hashes=tuple((r["relpath"], r["sha256"]) for r in fs),
            config=json.loads(row["config"]) if row["config"] else None, base_id=row["base_id"],
        ))
    return out


def load_tensors(conn: sa.Connection, checkpoint_id: str) -> list[TensorInfo]:
    return load_tensors_many(conn, [checkpoint_id])[checkpoint_id]


def load_tensors_many(conn: sa.Connection, checkpoint_ids: list[str]) -> dict[str, list[TensorInfo]]:
    """Tensors of each checkpoint in checkpoint order, one query for all of them."""
    t, f = schema.tensor, schema.source_file
    rows = conn.execute(
        sa.select(t.c.checkpoint_id, t.c.tensor_idx, t.c.name, t.c.dtype, t.c.shape, f.c.path, t.c.offset,
                  t.c.nbytes, t.c.rows_per_block, t.c.n_blocks, t.c.xxh3)
        .join(f, f.c.id == t.c.file_id)
        .where(t.c.checkpoint_id.in_(sorted(set(checkpoint_ids)))).order_by(t.c.checkpoint_id, t.c.tensor_idx)
    )
    out: dict[str, list[TensorInfo]] = {cid: [] for cid in checkpoint_ids}
    for cid, idx, name, dtype, shape, path, offset, nbytes, rpb, n_blocks, xxh3 in rows:
        out[cid].append(TensorInfo(idx, name, dtype, tuple(json.loads(shape)), path, offset, nbytes, rpb, n_blocks,
                                   xxh3))
    return out


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Resolved:
    """What a user-given name resolved to: a checkpoint, and the snapshot when it is a merge output."""

    checkpoint_id: str
    name: str
    kind: str
    snapshot_id: str | None


def resolve(conn: sa.Connection, name: str) -> Resolved:
    """Resolve `name` as a checkpoint name, a ref name (its current version) or a snapshot id.

    Raises UnknownCheckpointError when it is none of them.
    """
    c, r, s = schema.checkpoint, schema.ref, schema.snapshot
    row = conn.execute(sa.select(c.c.id, c.c.name, c.c.kind).where(c.c.name == name)).first()
    if row is None:
        sid = conn.execute(sa.select(r.c.snapshot_id).where(r.c.name == name)).scalar()
        if sid is None:
            sid = conn.execute(sa.select(s.c.id).where(s.c.id == name)).scalar()
        if sid is not None:
            row = conn.execute(
                sa.select(c.c.id, c.c.name, c.c.kind).join(s, s.c.checkpoint_id == c.c.id).where(s.c.id == sid)
            ).first()
    if row is None:
        raise UnknownCheckpointError(f"unknown checkpoint, ref or snapshot {name!r}")
    snap = conn.execute(
        sa.select(s.c.id).where(s.c.checkpoint_id == row.id, s.c.state == "COMMITTED")).scalar()
    return Resolved(row.id, row.name, row.kind, snap)


def resolve_snapshot(conn: sa.Connection, name: str) -> Resolved:
    """Like `resolve`, but the name must denote a committed merge snapshot (UnknownCheckpointError if not,
    listing the snapshots the catalog does have)."""
    try:
        res = resolve(conn, name)
    except UnknownCheckpointError as e:
        raise UnknownCheckpointError(f"{e}; {known_snapshots(conn)}") from e
    if res.snapshot_id is None:
        raise UnknownCheckpointError(f"{name!r} is a {res.kind} checkpoint, not a committed merge snapshot; "
                                     f"{known_snapshots(conn)}")
    return res


def known_snapshots(conn: sa.Connection, limit: int = 12) -> str:
    """One line naming the catalog's committed snapshots (newest first, at most `limit`), for error messages."""
    c, s = schema.checkpoint, schema.snapshot
    names = list(conn.execute(
        sa.select(c.c.name).join(s, s.c.checkpoint_id == c.c.id).where(s.c.state == "COMMITTED")
        .order_by(s.c.created_at.desc(), c.c.name).limit(limit + 1)).scalars())
    if not names:
        return "the catalog holds no committed snapshots (run `mergepipe merge` first)"
    more = " and more" if len(names) > limit else ""
    return "known snapshots: " + ", ".join(repr(n) for n in names[:limit]) + more
