"""fsck: cross-check the catalog, the published snapshots' files and manifests, staging leftovers and sources.

Each check yields a `Finding` of one kind:

- ``ok``: as recorded (or a merge still running on this host);
- ``leftover``: what an interrupted merge left and `gc --apply` collects: a staging directory or intent
  whose process is gone, or a snapshot the catalog committed but that was not yet renamed into place
  (gc rolls it forward);
- ``missing``: a committed snapshot's output directory or files are gone or have another size, or a
  catalogued source file is gone;
- ``corrupt``: the catalog contradicts itself (snapshot without manifest, ref to nowhere) or the files
  (manifest hash, sha256 with ``full``, a source changed since ingest).

Read-only: fsck never changes the catalog or a file. Only ``missing`` and ``corrupt`` need a person.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.db import schema
from mergepipe_db.db.engine import Database

KINDS = ("ok", "leftover", "missing", "corrupt")
#: Finding kinds that do not need a person (`mergepipe fsck` exits 0 when only these are found).
CLEAN_KINDS = frozenset({"ok", "leftover"})


@dataclass(frozen=True)
class Finding:
    """One result of `fsck`: `kind` is one of KINDS, `text` a one-line description."""

    kind: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text}

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


def problems(findings: list[Finding]) -> list[Finding]:
    """The findings that are neither ok nor a leftover gc collects."""
    return [f for f in findings if f.kind not in CLEAN_KINDS]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files_state(root: Path, files: list[Any], *, full: bool) -> tuple[str, str]:
    """('ok'|'missing'|'corrupt', detail) for catalogued files `files` (relpath, size, sha256) under `root`."""
    for f in files:
        p = root / f.relpath
        try:
            st = p.stat()
        except OSError:
            return "missing", f"file {f.relpath} is missing"
        if st.st_size != f.size:
            return "missing", f"file {f.relpath} has {st.st_size} bytes, catalog says {f.size}"
    if full:
        for f in files:
            got = _sha256(root / f.relpath)
            if got != f.sha256:
                return "corrupt", f"file {f.relpath} sha256 {got[:16]}… != catalog {f.sha256[:16]}…"
    return "ok", f"{len(files)} file(s)"


def _manifest_state(root: Path, expected_hash: str) -> tuple[str, str]:
    """Check `root/manifest.json` records (and hashes to) the catalog's manifest hash."""
    from mergepipe_db.commit import manifest_hash

    path = root / "manifest.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        recorded = doc["manifest_hash"]
        actual = manifest_hash(doc["manifest"])
    except FileNotFoundError:
        return "missing", "manifest.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "corrupt", f"manifest.json is unreadable ({type(e).__name__})"
    if recorded != actual:
        return "corrupt", "manifest.json content does not hash to its recorded manifest_hash"
    if recorded != expected_hash:
        return "corrupt", f"manifest.json hash {recorded[:16]}… != catalog manifest {expected_hash[:16]}…"
    return "ok", "manifest matches"


def _check_snapshots(db: Database, conn: sa.Connection, *, full: bool) -> list[Finding]:
    s, c, m, f, r = schema.snapshot, schema.checkpoint, schema.manifest, schema.source_file, schema.ref
    out: list[Finding] = []
    snaps = conn.execute(sa.select(s.c.id, s.c.ref, s.c.checkpoint_id, s.c.out_path, s.c.staging_path)
                         .order_by(s.c.created_at, s.c.id)).all()
    names = dict(conn.execute(sa.select(c.c.id, c.c.name).where(c.c.kind == "snapshot")).all())
    manifests = {sid: hashlib.sha256(text.encode("utf-8")).hexdigest()
                 for sid, text in conn.execute(sa.select(m.c.snapshot_id, m.c.manifest))}
    files: dict[str, list[Any]] = {}
    for row in conn.execute(sa.select(f.c.checkpoint_id, f.c.relpath, f.c.size, f.c.sha256)
                            .join(s, s.c.checkpoint_id == f.c.checkpoint_id).order_by(f.c.file_idx)):
        files.setdefault(row.checkpoint_id, []).append(row)
    refs = conn.execute(sa.select(r.c.name, r.c.snapshot_id, r.c.version)).all()

    by_id = {sn.id: sn for sn in snaps}
    for name, sid, version in refs:
        head = by_id.get(sid)
        if head is None:
            out.append(Finding("corrupt", f"ref {name!r} (version {version}) points to unknown snapshot {sid}"))
        elif names.get(head.checkpoint_id) != f"{name}@{version}":
            out.append(Finding("corrupt", f"ref {name!r} is at version {version} but its snapshot is "
                                          f"{names.get(head.checkpoint_id)!r}"))
    for sn in snaps:
        label = f"snapshot {names.get(sn.checkpoint_id, sn.id)} ({sn.id[:12]})"
        if sn.checkpoint_id not in names:
            out.append(Finding("corrupt", f"{label}: its output checkpoint row is missing"))
            continue
        if sn.id not in manifests:
            out.append(Finding("corrupt", f"{label}: its manifest row is missing"))
            continue
        ckfiles = files.get(sn.checkpoint_id, [])
        if not ckfiles:
            out.append(Finding("corrupt", f"{label}: the catalog lists no output files"))
            continue
        out.append(_snapshot_on_disk(label, sn, ckfiles, manifests[sn.id], full=full))
    return out


def _snapshot_on_disk(label: str, sn: Any, files: list[Any], mhash: str, *, full: bool) -> Finding:
    out_dir, staging = Path(sn.out_path), Path(sn.staging_path)
    for _attempt in range(2):
        if out_dir.is_dir():
            state, detail = _files_state(out_dir, files, full=full)
            if state == "ok":
                state, detail = _manifest_state(out_dir, mhash)
            if state == "ok":
                return Finding("ok", f"{label} at {out_dir}: {len(files)} file(s), manifest matches")
            return Finding(state, f"{label} at {out_dir}: {detail}")
        if staging.is_dir():
            state, detail = _files_state(staging, files, full=full)
            if state == "ok":
                state, detail = _manifest_state(staging, mhash)
            if state == "ok":
                return Finding("leftover", f"{label} is committed but not yet published at {out_dir}: "
                                           f"`mergepipe gc --apply` renames {staging.name} into place")
            if not staging.is_dir():  # published while we looked: look at --out again
                continue
            return Finding(state, f"{label} is committed but unpublished and its staging {staging} is "
                                  f"incomplete: {detail}")
    return Finding("missing", f"{label}: output directory {out_dir} is missing")


def _check_staging(db: Database, conn: sa.Connection) -> list[Finding]:
    """Intents of merges in flight (or interrupted), and stray staging directories next to known outputs."""
    from mergepipe_db.commit import STAGING_PREFIX

    st, s = schema.staging, schema.snapshot
    host = socket.gethostname()
    out: list[Finding] = []
    intents = conn.execute(sa.select(st)).mappings().all()
    snaps = conn.execute(sa.select(s.c.out_path, s.c.staging_path)).all()
    owned = {sp for _o, sp in snaps} | {it["staging_path"] for it in intents}
    for it in intents:
        pid = int(it["pid"])
        where = f"staging {it['staging_path']} (pid {pid} on {it['host']})"
        if it["host"] != host:
            out.append(Finding("ok", f"{where}: merge on another host, not checked from here"))
        elif _pid_alive(pid) and pid != os.getpid():
            out.append(Finding("ok", f"{where}: merge in progress"))
        else:
            out.append(Finding("leftover", f"{where}: merge interrupted; `mergepipe gc --apply` removes it"))
    parents = {Path(o).parent for o, _sp in snaps} | {Path(it["out_path"]).parent for it in intents}
    for parent in sorted(parents):
        if not parent.is_dir():
            continue
        for p in sorted(parent.glob(f"{STAGING_PREFIX}*")):
            if str(p) not in owned:
                out.append(Finding("leftover", f"stray staging directory {p}: `mergepipe gc --apply` removes it"))
    return out


def _check_sources(conn: sa.Connection, *, full: bool) -> list[Finding]:
    c, f = schema.checkpoint, schema.source_file
    rows = conn.execute(sa.select(c.c.name, f.c.path, f.c.size, f.c.mtime_ns, f.c.sha256)
                        .join(c, c.c.id == f.c.checkpoint_id).where(c.c.kind != "snapshot")
                        .order_by(c.c.name, f.c.file_idx)).all()
    by_ck: dict[str, list[Any]] = {}
    for row in rows:
        by_ck.setdefault(row.name, []).append(row)
    no_files = conn.execute(sa.select(c.c.name).where(c.c.kind != "snapshot",
                                                      ~sa.exists().where(f.c.checkpoint_id == c.c.id))).scalars()
    out = [Finding("corrupt", f"checkpoint {n!r}: the catalog lists no source files") for n in no_files]
    for name, files in by_ck.items():
        bad = []
        for r in files:
            try:
                stt = os.stat(r.path)
            except OSError:
                bad.append(Finding("missing", f"checkpoint {name!r}: source file {r.path} is missing"))
                continue
            if stt.st_size != r.size or stt.st_mtime_ns != r.mtime_ns:
                bad.append(Finding("corrupt", f"checkpoint {name!r}: source file {r.path} changed since ingest "
                                              f"(size {r.size} -> {stt.st_size} or mtime)"))
            elif full and _sha256(Path(r.path)) != r.sha256:
                bad.append(Finding("corrupt", f"checkpoint {name!r}: source file {r.path} content changed "
                                              f"(sha256 differs from ingest)"))
        out.extend(bad or [Finding("ok", f"checkpoint {name!r}: {len(files)} source file(s) as ingested")])
    return out


def fsck(db: Database, *, full: bool = False) -> list[Finding]:
    """Cross-check catalog, manifests and files; returns findings (see the module docstring for kinds).

    Sizes (and source mtimes) are compared by default; `full` also rehashes every file (sha256). Never
    raises for what it finds; a catalog it cannot open raises CatalogError.
    """
    with db.connect() as conn:
        # Staging first: a merge that commits meanwhile moves from intent to snapshot, never out of sight.
        found = _check_staging(db, conn)
        found = _check_snapshots(db, conn, full=full) + found
        found += _check_sources(conn, full=full)
    # A leftover intent whose merge finished while we looked is not a leftover: drop those.
    gone = [f for f in found if f.kind == "leftover" and f.text.startswith("staging ")]
    if gone:
        with db.connect() as conn:
            live = {p for (p,) in conn.execute(sa.select(schema.staging.c.staging_path))}
        found = [f for f in found if not (f in gone and f.text.split(" ", 2)[1] not in live)]
    return found
