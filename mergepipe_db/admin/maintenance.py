"""Maintenance: garbage collection of interrupted merges and verification of sources against the catalog."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.db import schema
from mergepipe_db.db.engine import Database
from mergepipe_db.io import as_path, is_remote, open_store
from mergepipe_db.pipeline.commit import STAGING_PREFIX


def pid_alive(pid: int, since: str | None = None) -> bool:
    """Is process `pid` alive, and (when `since`, an ISO time, is given) not a later process reusing the pid?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if since is None:
        return True
    try:  # Linux: the process's start time, from boot time + its start in clock ticks
        from datetime import datetime

        with open(f"/proc/{pid}/stat", "rb") as fh:
            start_ticks = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith(b"btime"))
        started = btime + start_ticks / os.sysconf("SC_CLK_TCK")
        return started <= datetime.fromisoformat(since).timestamp() + 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return True


def gc(db: Database, *, dry_run: bool = True) -> list[str]:
    """Find leftovers of interrupted merges; remove them (and roll committed ones forward) unless dry_run.

    - an intent whose process (on this host) is gone: its intent row, then its staging directory;
    - a committed snapshot whose output is not at `out_path` but whose staging directory is complete:
      published now (rename), since the catalog already made it visible;
    - stray `.mergepipe-staging-*` directories beside known outputs that no intent or snapshot owns.
    Intents of merges on other hosts are left alone (their process cannot be checked from here).
    Safe to run while merges run: staging directories are listed before ownership is read (a staging
    directory is created only after its intent row), and an intent is removed only if its row is still there
    (a merge that committed meanwhile owns its staging as a snapshot). Returns one line per action.
    """
    from mergepipe_db.pipeline.commit import publish

    actions: list[str] = []
    host = socket.gethostname()
    with db.connect() as conn:
        outs = set(conn.execute(sa.select(schema.snapshot.c.out_path)).scalars())
        outs |= set(conn.execute(sa.select(schema.staging.c.out_path)).scalars())
    parents = {Path(o).parent for o in outs if not is_remote(o)}
    listed = sorted(p for parent in sorted(parents) if parent.is_dir() for p in parent.glob(f"{STAGING_PREFIX}*"))
    with db.connect() as conn:  # intents before snapshots: a commit moves ownership from one to the other
        intents = conn.execute(sa.select(schema.staging)).mappings().all()
        snaps = conn.execute(sa.select(schema.snapshot.c.id, schema.snapshot.c.out_path,
                                       schema.snapshot.c.staging_path)).all()
    for it in intents:
        pid = int(it["pid"])
        if it["host"] != host:
            actions.append(f"skip staging {it['staging_path']} (merge on host {it['host']}, pid {pid}: "
                           f"run gc there)")
            continue
        if pid_alive(pid, it["created_at"]) and pid != os.getpid():
            continue
        actions.append(f"remove staging {it['staging_path']} (merge interrupted, pid {pid})")
        if not dry_run:
            with db.connect() as conn:
                gone = conn.execute(schema.staging.delete().where(schema.staging.c.id == it["id"])).rowcount
            if gone:
                _remove_staging(it["staging_path"])
    owned = {s.staging_path for s in snaps} | {it["staging_path"] for it in intents}
    for sid, out, staging in snaps:
        if is_remote(out):
            continue
        if not Path(out).exists() and Path(staging).is_dir() and (Path(staging) / "manifest.json").is_file():
            actions.append(f"publish committed snapshot {sid} at {out}")
            if not dry_run:
                publish(Path(staging), Path(out))
    for p in listed:
        if str(p) in owned or not p.is_dir():
            continue
        actions.append(f"remove stray staging {p}")
        if not dry_run:
            shutil.rmtree(p, ignore_errors=True)
    remote = sorted(o for o in outs if is_remote(o))
    if remote:
        actions += _gc_remote(remote, snaps, owned, dry_run=dry_run)
    return actions


def _remove_staging(record: str) -> None:
    """Remove an abandoned staging directory, or an object-store attempt's objects (`io.s3.abandon_attempt`)."""
    if is_remote(record):
        from mergepipe_db.io.s3 import AttemptPrefix, abandon_attempt

        attempt = AttemptPrefix.parse(record)
        if attempt is not None:
            abandon_attempt(attempt)
        return
    shutil.rmtree(record, ignore_errors=True)


def _gc_remote(prefixes: list[str], snaps: Any, owned: set[str], *, dry_run: bool) -> list[str]:
    """`gc` of outputs in an object store: a committed snapshot whose manifest.json was not written yet gets it
    (its attempt's staged copy; the catalog already made it visible); the objects of attempts that no intent
    or snapshot owns are removed; incomplete multipart uploads under the prefixes are aborted."""
    from mergepipe_db.io.s3 import AttemptPrefix, incomplete_uploads, publish_attempt, published, stray_attempts

    actions: list[str] = []
    for sid, out, staging in snaps:
        attempt = AttemptPrefix.parse(staging or "")
        if is_remote(out) and attempt is not None and not published(out) and _is_file(attempt / "manifest.json"):
            actions.append(f"publish committed snapshot {sid} at {out} (write manifest.json)")
            if not dry_run:
                publish_attempt(attempt)
    for prefix in prefixes:
        for attempt in stray_attempts(prefix, owned):
            actions.append(f"remove stray objects of merge attempt {attempt.attempt} under {prefix}")
            if not dry_run:
                from mergepipe_db.io.s3 import abandon_attempt

                abandon_attempt(attempt)
        for key, upload_id in incomplete_uploads(prefix):
            actions.append(f"abort incomplete multipart upload of {key}")
            if not dry_run:
                from mergepipe_db.io.s3 import abort_upload

                abort_upload(key, upload_id)
    return actions


def verify_sources(db: Database, *, full: bool = False, checkpoint: str | None = None,
                   exclude_snapshots: bool = False) -> list[str]:
    """Problems with catalogued source files: missing, size/mtime changed, or (full) sha256 mismatch.

    `exclude_snapshots` skips merge outputs (kind 'snapshot'; `verify_snapshot` checks those in depth).
    """
    f, c = schema.source_file, schema.checkpoint
    q = sa.select(c.c.name, f.c.path, f.c.size, f.c.mtime_ns, f.c.sha256).join(c, c.c.id == f.c.checkpoint_id)
    if checkpoint is not None:
        q = q.where(c.c.name == checkpoint)
    if exclude_snapshots:
        q = q.where(c.c.kind != "snapshot")
    with db.connect() as conn:
        rows = conn.execute(q.order_by(c.c.name, f.c.file_idx)).all()
    problems = []
    for name, path, size, mtime_ns, sha in rows:
        try:
            st = open_store(path).stat(path)  # size and version (the mtime ingest recorded)
        except FileNotFoundError:
            problems.append(f"{name}: {path} is missing")
            continue
        if st.size != size or st.version != mtime_ns:
            problems.append(f"{name}: {path} changed since ingest (size or mtime)")
            continue
        if full:
            got = open_store(path).sha256(path)
            if got != sha:
                problems.append(f"{name}: {path} content changed (sha256 {got[:16]}… != {sha[:16]}…)")
    return problems


def verify_snapshot(db: Database, snapshot_ref: str) -> list[str]:
    """Rehash a committed snapshot's output files at its `out_path` against its manifest.

    Checks every output file's sha256 (manifest ``outputs.files``) and every tensor's xxh3_128 (manifest
    ``outputs.tensors``; tensors located through each file's safetensors header), and that `manifest.json`
    on disk is the catalog's. Returns one line per problem, naming the file or tensor; [] when all match.
    `snapshot_ref` is a snapshot checkpoint name (``ref@version``), a ref or a snapshot id; anything else
    raises UnknownCheckpointError.
    """
    import json

    import xxhash

    from mergepipe_db.db.checkpoints import resolve_snapshot
    from mergepipe_db.errors import MergePipeError
    from mergepipe_db.formats.safetensors import read_header

    s, m = schema.snapshot, schema.manifest
    with db.connect() as conn:
        res = resolve_snapshot(conn, snapshot_ref)
        out_path, staging_path, text = conn.execute(
            sa.select(s.c.out_path, s.c.staging_path, m.c.manifest).join(m, m.c.snapshot_id == s.c.id)
            .where(s.c.id == res.snapshot_id)).one()
    label = f"snapshot {res.name}"
    out, where = _output_location(out_path, staging_path)
    if not is_remote(out_path) and not out.is_dir():
        return [f"{label}: output directory {out} is missing"]
    manifest = json.loads(text)
    problems: list[str] = []
    mhash = hashlib.sha256(text.encode("utf-8")).hexdigest()
    try:
        doc = json.loads(open_store(out).read_small(out / "manifest.json", 1 << 30).decode("utf-8"))
        if doc.get("manifest_hash") != mhash or _canonical_sha256(doc.get("manifest")) != mhash:
            problems.append(f"{label}: manifest.json differs from the catalog's manifest {mhash[:16]}…")
    except (OSError, ValueError, AttributeError) as e:
        problems.append(f"{label}: manifest.json is missing or unreadable ({type(e).__name__})")

    outputs = manifest.get("outputs", {})
    expected = {str(t[0]): (str(t[1]), [int(x) for x in t[2]], str(t[3])) for t in outputs.get("tensors", [])}
    seen: set[str] = set()
    all_headers_read = True
    for rel, sha in outputs.get("files", []):
        path = where(rel)
        if not _is_file(path):
            problems.append(f"{label}: file {rel} is missing")
            all_headers_read = False
            continue
        got = open_store(path).sha256(path)
        if got != sha:
            problems.append(f"{label}: file {rel} differs (sha256 {got[:16]}… != manifest {sha[:16]}…)")
        try:
            header = read_header(path)
        except MergePipeError as e:
            problems.append(f"{label}: file {rel} has an unreadable header, its tensors cannot be checked: "
                            f"{' '.join(str(e).split())}")
            all_headers_read = False
            continue
        with open_store(path).open_input(path) as fh:
            for t in header.tensors:
                want = expected.get(t.name)
                if want is None:
                    problems.append(f"{label}: file {rel} holds tensor {t.name!r}, which the manifest does not list")
                    continue
                seen.add(t.name)
                if (t.dtype, list(t.shape)) != (want[0], want[1]):
                    problems.append(f"{label}: tensor {t.name!r} in {rel} is {t.dtype} {list(t.shape)}, manifest "
                                    f"says {want[0]} {want[1]}")
                    continue
                x = xxhash.xxh3_128()
                left = t.nbytes
                for chunk in fh.pieces(header.absolute_offset(t), t.nbytes, 16 << 20):
                    x.update(chunk)
                    left -= len(chunk)
                if left or x.hexdigest() != want[2]:
                    problems.append(f"{label}: tensor {t.name!r} in {rel} differs (xxh3 {x.hexdigest()[:16]}… != "
                                    f"manifest {want[2][:16]}…)")
    if all_headers_read:
        for name in sorted(set(expected) - seen):
            problems.append(f"{label}: tensor {name!r} is missing from the output files")
    return problems


def _output_location(out_path: str, staging_path: str | None) -> tuple[Any, Any]:
    """(the output's location, NAME -> location of its output file NAME): in an object store the shards carry
    the attempt that wrote them (`io.s3.AttemptPrefix`, from the snapshot's staging record)."""
    out = as_path(out_path)
    if is_remote(out_path):
        from mergepipe_db.io.s3 import AttemptPrefix

        attempt = AttemptPrefix.parse(staging_path or "")
        if attempt is not None:
            return out, lambda rel: attempt / rel
    return out, lambda rel: out / rel


def _is_file(path: Any) -> bool:
    if is_remote(str(path)):
        try:
            open_store(path).stat(path)
        except FileNotFoundError:
            return False
        return True
    return Path(path).is_file()


def _canonical_sha256(obj: object) -> str:
    import json

    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def committed_snapshots(db: Database) -> list[str]:
    """Checkpoint names (``ref@version``) of every committed snapshot, oldest first."""
    s, c = schema.snapshot, schema.checkpoint
    with db.connect() as conn:
        return list(conn.execute(sa.select(c.c.name).join(s, s.c.checkpoint_id == c.c.id)
                                 .where(s.c.state == "COMMITTED").order_by(s.c.created_at, c.c.name)).scalars())


def verify_all(db: Database, name: str | None = None, *, full: bool = False) -> tuple[list[str], list[str]]:
    """`mergepipe verify [NAME]`: (problems, what was checked).

    NAME a snapshot, ref or snapshot id → that snapshot's outputs (`verify_snapshot`); NAME another
    checkpoint → its source files (`verify_sources`); no NAME → every source file of the original
    checkpoints and every committed snapshot. Raises UnknownCheckpointError for an unknown NAME.
    """
    from mergepipe_db.db.checkpoints import resolve

    if name is not None:
        with db.connect() as conn:
            res = resolve(conn, name)
        if res.snapshot_id is not None:
            return verify_snapshot(db, res.snapshot_id), [f"snapshot {res.name} (outputs)"]
        return verify_sources(db, full=full, checkpoint=res.name), [f"checkpoint {res.name} (sources)"]
    problems = verify_sources(db, full=full, exclude_snapshots=True)
    checked = ["sources of every checkpoint"]
    for snap in committed_snapshots(db):
        problems += verify_snapshot(db, snap)
        checked.append(f"snapshot {snap} (outputs)")
    return problems, checked
