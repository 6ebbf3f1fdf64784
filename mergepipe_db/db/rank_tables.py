"""The ranking summaries and tensor sketches a checkpoint's blocks get in the catalog (mp_rank_tensor,
mp_rank_bucket, mp_tensor_sketch), written in the transaction that inserts the blocks (ingest, commit), and
read back by the planner and fsck. What they are for: `pipeline/plan/ranking.py`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa

from mergepipe_db.core import sketch
from mergepipe_db.db import schema
from mergepipe_db.db.fetch import fetch_columns, pylist
from mergepipe_db.db.sql_files import sql_text


def tensor_sketches(conn: sa.Connection, expert_id: str) -> dict[int, tuple[np.ndarray, bool]]:
    """Per tensor of one checkpoint (its own tensor_idx): the sum of its block sketches (the tensor's exact
    |Δ| histogram) and whether every row block has one, as `ranking.write` stored them (mp_tensor_sketch)."""
    ts = schema.tensor_sketch
    rows = conn.execute(sa.select(ts.c.tensor_idx, ts.c.sketch, ts.c.complete).where(ts.c.checkpoint_id == expert_id))
    return {int(tidx): (sketch.decode(blob), bool(complete)) for tidx, blob, complete in rows}


def write(conn: sa.Connection, checkpoint_id: str) -> None:
    """Insert the ranking summaries and tensor sketches of one checkpoint, from its rows in mp_block (same
    transaction)."""
    for name in ("rank_tensor_insert", "rank_bucket_insert"):
        conn.execute(sa.text(sql_text(name)), {"checkpoint_id": checkpoint_id})
    write_tensor_sketches(conn, checkpoint_id)


def write_tensor_sketches(conn: sa.Connection, checkpoint_id: str) -> None:
    """Insert mp_tensor_sketch rows of one checkpoint: per tensor, the sum of its block sketches."""
    rows = [{"checkpoint_id": checkpoint_id, "tensor_idx": tidx, "sketch": sketch.encode(hist), "complete": complete}
            for tidx, (hist, complete) in sorted(tensor_sketches_from_blocks(conn, checkpoint_id).items())]
    if rows:
        conn.execute(schema.tensor_sketch.insert(), rows)


def tensor_sketches_from_blocks(conn: sa.Connection, checkpoint_id: str) -> dict[int, tuple[np.ndarray, bool]]:
    """Per tensor of one checkpoint (its own tensor_idx) with at least one block sketch: the sum of its block
    sketches (the tensor's exact |Δ| histogram) and whether every row block (block_idx >= 0) has one."""
    b = schema.block
    incomplete = set(conn.execute(
        sa.select(b.c.tensor_idx).where(b.c.checkpoint_id == checkpoint_id, b.c.sketch.is_(None),
                                        b.c.block_idx >= 0).group_by(b.c.tensor_idx)).scalars())
    cols = fetch_columns(conn, conn.execute(sa.select(b.c.tensor_idx, b.c.sketch).where(
        b.c.checkpoint_id == checkpoint_id, b.c.sketch.is_not(None))))
    owners = np.asarray(cols["tensor_idx"], dtype=np.int64)
    tensors = np.unique(owners)
    sums = sketch.decode_sum(pylist(cols["sketch"]), np.searchsorted(tensors, owners), len(tensors))
    return {int(t): (sums[i], int(t) not in incomplete) for i, t in enumerate(tensors.tolist())}


def rewrite(conn: sa.Connection, checkpoint_ids: Iterable[str]) -> None:
    """Replace the summaries of `checkpoint_ids` (after their blocks were changed in place, e.g. by a test or a
    repair; the catalog itself never changes a block after inserting it)."""
    for cid in checkpoint_ids:
        for table in (schema.rank_tensor, schema.rank_bucket, schema.tensor_sketch):
            conn.execute(table.delete().where(table.c.checkpoint_id == cid))
        write(conn, cid)


def rank_key(row: dict[str, Any]) -> tuple[int, float]:
    l2 = row.get("delta_l2")
    if l2 is None:
        return (2, 0.0)
    if l2 != l2:  # NaN ranks first, as in SQL (it compares above every number)
        return (0, 0.0)
    return (1, -l2)


def in_rank_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Block rows in descending delta_l2 (NaN first, NULL last; stable), the order they are inserted in."""
    return sorted(rows, key=rank_key)
