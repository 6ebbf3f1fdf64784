"""Maintenance: garbage collection of interrupted merges and verification of sources against the catalog."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import sqlalchemy as sa

from mergepipe_db.commit import STAGING_PREFIX
from mergepipe_db.db import schema
from mergepipe_db.db.engine import Database


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gc(db: Database, *, dry_run: bool = True) -> list[str]:
    """Find leftovers of interrupted merges; remove them (and roll committed ones forward) unless dry_run.

    - an intent whose process is gone: its staging directory and intent row;
    - a committed snapshot whose output is not at `out_path` but whose staging directory is complete:
      published now (rename), since the catalog already made it visible;
    - stray `.mergepipe-staging-*` directories beside known outputs that no intent or snapshot owns.
    Returns one line per action taken (or that would be taken).
    """
    actions: list[str] = []
    host = socket.gethostname()
    with db.connect() as conn:
        intents = conn.execute(sa.select(schema.staging)).mappings().all()
        snaps = conn.execute(sa.select(schema.snapshot.c.id, schema.snapshot.c.out_path,
                                       schema.snapshot.c.staging_path)).all()
    live = set()
    for it in intents:
        if it["host"] == host and _pid_alive(int(it["pid"])) and int(it["pid"]) != os.getpid():
            live.add(it["staging_path"])
            continue
        actions.append(f"remove staging {it['staging_path']} (merge interrupted, pid {it['pid']})")
        if not dry_run:
            shutil.rmtree(it["staging_path"], ignore_errors=True)
            with db.connect() as conn:
                conn.execute(schema.staging.delete().where(schema.staging.c.id == it["id"]))
    owned = {s.staging_path for s in snaps} | {it["staging_path"] for it in intents}
    for sid, out, staging in snaps:
        if not Path(out).exists() and Path(staging).is_dir() and (Path(staging) / "manifest.json").is_file():
            actions.append(f"publish committed snapshot {sid} at {out}")
            if not dry_run:
                from mergepipe_db.commit import publish

                publish(Path(staging), Path(out))
    parents = {Path(out).parent for _sid, out, _st in snaps} | {Path(it["out_path"]).parent for it in intents}
    for parent in sorted(parents):
        if not parent.is_dir():
            continue
        for p in sorted(parent.glob(f"{STAGING_PREFIX}*")):
            if str(p) in owned or str(p) in live:
                continue
            actions.append(f"remove stray staging {p}")
            if not dry_run:
                shutil.rmtree(p, ignore_errors=True)
    return actions


def verify_sources(db: Database, *, full: bool = False, checkpoint: str | None = None) -> list[str]:
    """Problems with catalogued source files: missing, size/mtime changed, or (full) sha256 mismatch."""
    f, c = schema.source_file, schema.checkpoint
    q = sa.select(c.c.name, f.c.path, f.c.size, f.c.mtime_ns, f.c.sha256).join(c, c.c.id == f.c.checkpoint_id)
    if checkpoint is not None:
        q = q.where(c.c.name == checkpoint)
    with db.connect() as conn:
        rows = conn.execute(q.order_by(c.c.name, f.c.file_idx)).all()
    problems = []
    for name, path, size, mtime_ns, sha in rows:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problems.append(f"{name}: {path} is missing")
            continue
        if st.st_size != size or st.st_mtime_ns != mtime_ns:
            problems.append(f"{name}: {path} changed since ingest (size or mtime)")
            continue
        if full:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
            if h.hexdigest() != sha:
                problems.append(f"{name}: {path} content changed (sha256 {h.hexdigest()[:16]}… != {sha[:16]}…)")
    return problems
