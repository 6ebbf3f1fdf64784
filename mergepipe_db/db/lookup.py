"""Resolving the model references users give (checkpoint names, refs, paths of catalogued checkpoints) to
catalogued checkpoints, and checking that a merge's experts belong to its base's family."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from mergepipe_db.core.spec import MergeSpec
from mergepipe_db.db import schema
from mergepipe_db.errors import CoordinateMismatchError, SpecError


def find_model(conn: sa.Connection, ref: str) -> tuple[str, str] | None:
    """(id, name) of a catalogued model reference: a checkpoint name, a ref, or the root path of a catalogued
    full checkpoint; None if it is none of these."""
    found = lookup(conn, ref)
    if found is None and Path(ref).exists():
        root = str(Path(ref).resolve() if Path(ref).is_dir() else Path(ref).resolve().parent)
        c = schema.checkpoint
        found = conn.execute(sa.select(c.c.id).where(c.c.root == root, c.c.kind == "full")
                             .order_by(c.c.created_at)).scalar()
    if found is None:
        return None
    name = conn.execute(sa.select(schema.checkpoint.c.name).where(schema.checkpoint.c.id == found)).scalar_one()
    return found, name


def find_models(conn: sa.Connection, refs: list[str]) -> list[tuple[str, str] | None]:
    """`find_model` of each of `refs`, names and refs looked up together (three queries, not two per model)."""
    c, r = schema.checkpoint, schema.ref
    by_name = {name: (cid, name) for cid, name in conn.execute(sa.select(c.c.id, c.c.name)
                                                               .where(c.c.name.in_(sorted(set(refs)))))}
    pending = sorted({x for x in refs if x not in by_name})
    by_ref: dict[str, tuple[str, str]] = {}
    if pending:
        snapshots = dict(conn.execute(sa.select(r.c.name, r.c.snapshot_id).where(r.c.name.in_(pending))).all())
        names = dict(conn.execute(sa.select(c.c.id, c.c.name).where(c.c.id.in_(sorted(set(snapshots.values())))))
                     .all()) if snapshots else {}
        by_ref = {ref: (sid, names[sid]) for ref, sid in snapshots.items() if sid in names}
    return [by_name.get(x) or by_ref.get(x) or find_model(conn, x) for x in refs]


def lookup(conn: sa.Connection, ref: str) -> str | None:
    c = schema.checkpoint
    found = conn.execute(sa.select(c.c.id).where(c.c.name == ref)).scalar()
    if found is None:
        found = conn.execute(sa.select(schema.ref.c.snapshot_id).where(schema.ref.c.name == ref)).scalar()
    return found


def check_family(conn: sa.Connection, base_id: str, expert_ids: list[str], spec: MergeSpec) -> None:
    """Every expert must be catalogued against this base (same coordinates, same blocking): SpecError or
    CoordinateMismatchError otherwise."""
    c = schema.checkpoint
    rows = {r.id: r for r in conn.execute(sa.select(c.c.id, c.c.name, c.c.base_id, c.c.kind)
                                          .where(c.c.id.in_(expert_ids)))}
    for eid, m in zip(expert_ids, spec.models):
        r = rows[eid]
        if eid == base_id:
            raise SpecError(f"model {m.ref!r} is the base model itself")
        if r.base_id != base_id:
            t = schema.tensor
            base_sig = conn.execute(sa.select(t.c.name, t.c.dtype, t.c.shape).where(t.c.checkpoint_id == base_id)
                                    .order_by(t.c.name)).all()
            mine = conn.execute(sa.select(t.c.name, t.c.dtype, t.c.shape).where(t.c.checkpoint_id == eid)
                                .order_by(t.c.name)).all()
            if [tuple(x) for x in base_sig] != [tuple(x) for x in mine]:
                raise CoordinateMismatchError(
                    f"model {m.ref!r} does not share the coordinates of base {spec.base!r}")
            if r.kind != "snapshot":
                raise SpecError(f"model {m.ref!r} was ingested against another base; re-ingest it with "
                                f"--base {spec.base}")

