"""fsck: cross-check the catalog, the published snapshots' files and manifests, staging leftovers and sources.

Each check yields a `Finding` of one kind:

- ``ok``: as recorded (or a merge still running on this host);
- ``leftover``: what an interrupted merge left and `gc --apply` collects: a staging directory or intent
  whose process is gone, or a snapshot the catalog committed but that was not yet renamed into place
  (gc rolls it forward);
- ``missing``: a committed snapshot's output directory or files are gone or have another size, a catalogued
  source file is gone, or a packed block store is gone or shorter than the blobs it holds;
- ``corrupt``: the catalog contradicts itself (snapshot without manifest, ref to nowhere, ranking summaries
  that disagree with the blocks) or the files (manifest hash, sha256 with ``full``, a source changed since
  ingest).

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

from mergepipe_db.admin.maintenance import pid_alive
from mergepipe_db.core import sketch
from mergepipe_db.db import rank_tables, schema
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import MergePipeError
from mergepipe_db.io import as_path, is_remote, open_store
from mergepipe_db.sources import kinds

KINDS = ("ok", "leftover", "missing", "corrupt")
#: Finding kinds that do not need a person (`mergepipe fsck` exits 0 when only these are found).
CLEAN_KINDS = frozenset({"ok", "leftover"})


@dataclass(frozen=True)
class Finding:
    """One result of `fsck`: `kind` is one of KINDS, `text` a one-line description."""

    kind: str
    text: str
    path: str | None = None  # the directory or file the finding is about, when there is one

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, "path": self.path}

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


def problems(findings: list[Finding]) -> list[Finding]:
    """The findings that are neither ok nor a leftover gc collects."""
    return [f for f in findings if f.kind not in CLEAN_KINDS]


def _sha256_or_none(path: Any) -> str | None:
    try:
        return open_store(path).sha256(path)
    except OSError:
        return None


def _files_state(root: Path, files: list[Any], *, full: bool) -> tuple[str, str]:
    """('ok'|'missing'|'corrupt', detail) for catalogued files `files` (relpath, size, sha256) under `root`."""
    for f in files:
        p = root / f.relpath
        try:
            size = open_store(p).stat(p).size
        except OSError:
            return "missing", f"file {f.relpath} is missing"
        if size != f.size:
            return "missing", f"file {f.relpath} has {size} bytes, catalog says {f.size}"
    if full:
        for f in files:
            try:
                got = open_store(root).sha256(root / f.relpath)
            except OSError:
                return "missing", f"file {f.relpath} is unreadable"
            if got != f.sha256:
                return "corrupt", f"file {f.relpath} sha256 {got[:16]}… != catalog {f.sha256[:16]}…"
    return "ok", f"{len(files)} file(s)"


def _manifest_state(root: Path, expected_hash: str) -> tuple[str, str]:
    """Check `root/manifest.json` records (and hashes to) the catalog's manifest hash."""
    from mergepipe_db.core.manifest import manifest_hash

    path = root / "manifest.json"
    try:
        doc = json.loads(open_store(path).read_small(path, 1 << 30).decode("utf-8"))
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


@dataclass
class _State:
    """What fsck read from the catalog (one consistent read), checked against the disk afterwards."""

    intents: list[Any]
    snapshots: list[Any]
    names: dict[str, str]
    manifests: dict[str, str]
    outputs: dict[str, list[Any]]
    refs: list[Any]
    sources: dict[str, list[Any]]
    no_files: list[str]
    stores: dict[str, tuple[int, int]]  # packed block store file -> (blobs, bytes the catalog says it holds)


def _read_state(conn: sa.Connection) -> _State:
    s, c, m, f, r, st = (schema.snapshot, schema.checkpoint, schema.manifest, schema.source_file, schema.ref,
                         schema.staging)
    # Intents before snapshots: a merge committing meanwhile moves from one to the other, never out of sight.
    intents = conn.execute(sa.select(st)).mappings().all()
    snaps = conn.execute(sa.select(s.c.id, s.c.ref, s.c.checkpoint_id, s.c.out_path, s.c.staging_path)
                         .order_by(s.c.created_at, s.c.id)).all()
    ingested = c.c.kind.in_(kinds())  # source checkpoints; the others are merges' snapshots
    names = dict(conn.execute(sa.select(c.c.id, c.c.name).where(~ingested)).all())
    manifests = {sid: hashlib.sha256(text.encode("utf-8")).hexdigest()
                 for sid, text in conn.execute(sa.select(m.c.snapshot_id, m.c.manifest))}
    outputs: dict[str, list[Any]] = {}
    for row in conn.execute(sa.select(f.c.checkpoint_id, f.c.relpath, f.c.size, f.c.sha256)
                            .join(s, s.c.checkpoint_id == f.c.checkpoint_id).order_by(f.c.file_idx)):
        outputs.setdefault(row.checkpoint_id, []).append(row)
    refs = conn.execute(sa.select(r.c.name, r.c.snapshot_id, r.c.version).order_by(r.c.name)).all()
    sources: dict[str, list[Any]] = {}
    for src in conn.execute(sa.select(c.c.name, f.c.path, f.c.size, f.c.mtime_ns, f.c.sha256)
                            .join(c, c.c.id == f.c.checkpoint_id).where(ingested)
                            .order_by(c.c.name, f.c.file_idx)):
        sources.setdefault(src.name, []).append(src)
    no_files = list(conn.execute(sa.select(c.c.name).where(
        ingested, ~sa.exists().where(f.c.checkpoint_id == c.c.id)).order_by(c.c.name)).scalars())
    b = schema.blob
    stores = {path: (int(n), int(end or 0)) for path, n, end in conn.execute(
        sa.select(b.c.store_path, sa.func.count(), sa.func.max(b.c.offset + b.c.clen)).group_by(b.c.store_path))}
    return _State(list(intents), list(snaps), names, manifests, outputs, list(refs), sources, no_files, stores)


def _check_stores(state: _State) -> list[Finding]:
    """Packed block stores: each file holds at least every byte the catalog points into (appends may follow)."""
    out = []
    for path, (n, end) in sorted(state.stores.items()):
        try:
            size = os.stat(path).st_size
        except OSError:
            out.append(Finding("missing", f"packed block store {path} ({n} blobs) is missing", path))
            continue
        if size < end:
            out.append(Finding("missing", f"packed block store {path} has {size} bytes, its {n} blobs need {end}",
                               path))
        else:
            out.append(Finding("ok", f"packed block store {path}: {n} blobs within its {size} bytes", path))
    return out


def _check_refs(state: _State) -> list[Finding]:
    out = []
    by_id = {sn.id: sn for sn in state.snapshots}
    for name, sid, version in state.refs:
        head = by_id.get(sid)
        if head is None:
            out.append(Finding("corrupt", f"ref {name!r} (version {version}) points to unknown snapshot {sid}"))
        elif state.names.get(head.checkpoint_id) != f"{name}@{version}":
            out.append(Finding("corrupt", f"ref {name!r} is at version {version} but points to snapshot "
                                          f"{state.names.get(head.checkpoint_id)!r}"))
    return out


def _check_snapshots(state: _State, *, full: bool) -> list[Finding]:
    out: list[Finding] = []
    for sn in state.snapshots:
        label = f"snapshot {state.names.get(sn.checkpoint_id, sn.id)} ({sn.id[:12]})"
        if sn.checkpoint_id not in state.names:
            out.append(Finding("corrupt", f"{label}: its output checkpoint row is missing", sn.out_path))
        elif sn.id not in state.manifests:
            out.append(Finding("corrupt", f"{label}: its manifest row is missing", sn.out_path))
        elif not state.outputs.get(sn.checkpoint_id):
            out.append(Finding("corrupt", f"{label}: the catalog lists no output files", sn.out_path))
        else:
            out.append(_snapshot_on_disk(label, sn, state.outputs[sn.checkpoint_id], state.manifests[sn.id],
                                         full=full))
    return out


def _snapshot_in_store(label: str, sn: Any, files: list[Any], mhash: str, *, full: bool) -> Finding:
    """`_snapshot_on_disk` of an output in an object store: its objects (the keys of the attempt that wrote
    them) and ``manifest.json``, written last; committed with no manifest.json yet but its attempt's staged
    one present: a leftover that `gc --apply` rolls forward."""
    from mergepipe_db.io.s3 import AttemptPrefix

    out = as_path(sn.out_path)
    state, detail = _files_state(out, files, full=full)
    if state == "ok":
        state, detail = _manifest_state(out, mhash)
    if state == "ok":
        return Finding("ok", f"{label} at {out}: {len(files)} file(s), manifest matches", str(out))
    attempt = AttemptPrefix.parse(sn.staging_path or "")
    if detail == "manifest.json is missing" and attempt is not None:
        staged = attempt / "manifest.json"
        try:
            open_store(staged).stat(staged)
            return Finding("leftover", f"{label} is committed but its manifest.json is not yet written at {out}: "
                                       "`mergepipe gc --apply` writes it", str(out))
        except FileNotFoundError:
            pass
    return Finding(state, f"{label} at {out}: {detail}", str(out))


def _snapshot_on_disk(label: str, sn: Any, files: list[Any], mhash: str, *, full: bool) -> Finding:
    if is_remote(sn.out_path):
        return _snapshot_in_store(label, sn, files, mhash, full=full)
    out_dir, staging = Path(sn.out_path), Path(sn.staging_path)
    for _attempt in range(2):
        if out_dir.is_dir():
            state, detail = _files_state(out_dir, files, full=full)
            if state == "ok":
                state, detail = _manifest_state(out_dir, mhash)
            if state == "ok":
                return Finding("ok", f"{label} at {out_dir}: {len(files)} file(s), manifest matches", str(out_dir))
            return Finding(state, f"{label} at {out_dir}: {detail}", str(out_dir))
        if staging.is_dir():
            state, detail = _files_state(staging, files, full=full)
            if state == "ok":
                state, detail = _manifest_state(staging, mhash)
            if state == "ok":
                return Finding("leftover", f"{label} is committed but not yet published at {out_dir}: "
                                           f"`mergepipe gc --apply` renames {staging.name} into place", str(staging))
            if staging.is_dir():
                return Finding(state, f"{label} is committed but unpublished and its staging {staging} is "
                                      f"incomplete: {detail}", str(staging))
        # else: published between the two looks (staging renamed to --out): look at --out once more
    return Finding("missing", f"{label}: output directory {out_dir} is missing", str(out_dir))


def _check_intents(state: _State) -> list[Finding]:
    host = socket.gethostname()
    out = []
    for it in state.intents:
        pid = int(it["pid"])
        where = f"staging {it['staging_path']} (pid {pid} on {it['host']})"
        if it["host"] != host:
            out.append(Finding("ok", f"{where}: merge on another host, not checked from here", it["staging_path"]))
        elif pid_alive(pid, it["created_at"]) and pid != os.getpid():
            out.append(Finding("ok", f"{where}: merge in progress", it["staging_path"]))
        else:
            out.append(Finding("leftover", f"{where}: merge interrupted; `mergepipe gc --apply` removes it",
                               it["staging_path"]))
    return out


def _check_sources(state: _State, *, full: bool) -> list[Finding]:
    out = [Finding("corrupt", f"checkpoint {n!r}: the catalog lists no source files") for n in state.no_files]
    for name, files in state.sources.items():
        bad = []
        for r in files:
            try:
                stt = open_store(r.path).stat(r.path)  # size and version (the mtime ingest recorded)
            except OSError:
                bad.append(Finding("missing", f"checkpoint {name!r}: source file {r.path} is missing", r.path))
                continue
            if stt.size != r.size or stt.version != r.mtime_ns:
                bad.append(Finding("corrupt", f"checkpoint {name!r}: source file {r.path} changed since ingest "
                                              f"(size {r.size} -> {stt.size}, or mtime)", r.path))
            elif full and _sha256_or_none(r.path) != r.sha256:
                bad.append(Finding("corrupt", f"checkpoint {name!r}: source file {r.path} content changed "
                                              f"(sha256 differs from ingest)", r.path))
        out.extend(bad or [Finding("ok", f"checkpoint {name!r}: {len(files)} source file(s) as ingested")])
    return out


def _check_summaries(conn: sa.Connection) -> list[Finding]:
    """Each checkpoint's ranking summaries (db/rank_tables.py) agree with its blocks: per tensor the candidates, their
    bytes, the unscored ones and the summed sketch; per checkpoint the scored candidates and their bytes in the
    buckets. The planner reads plans from them; they are written with the blocks and never change, so a
    difference means the catalog was edited by hand."""
    b, t, k, c = schema.block, schema.rank_tensor, schema.rank_bucket, schema.checkpoint
    candidate = sa.or_(b.c.delta_l2.is_(None), b.c.delta_l2 != 0)
    scored = sa.case((b.c.delta_l2.is_(None), 0), else_=1)
    blocks: dict[str, dict[int, tuple[int, int, int]]] = {}
    scored_totals: dict[str, tuple[int, int]] = {}
    for cid, tidx, n, nbytes, n_scored, scored_bytes in conn.execute(
            sa.select(b.c.checkpoint_id, b.c.tensor_idx, sa.func.count(), sa.func.sum(b.c.nbytes),
                      sa.func.sum(scored), sa.func.sum(scored * b.c.nbytes)).where(candidate)
            .group_by(b.c.checkpoint_id, b.c.tensor_idx)):
        blocks.setdefault(cid, {})[int(tidx)] = (int(n), int(nbytes), int(n) - int(n_scored))
        a, z = scored_totals.get(cid, (0, 0))
        scored_totals[cid] = (a + int(n_scored), z + int(scored_bytes))
    tensors: dict[str, dict[int, tuple[int, int, int]]] = {}
    for cid, tidx, n, nbytes, unscored in conn.execute(
            sa.select(t.c.checkpoint_id, t.c.tensor_idx, t.c.candidates, t.c.candidate_bytes, t.c.unscored)):
        tensors.setdefault(cid, {})[int(tidx)] = (int(n), int(nbytes), int(unscored))
    buckets = {cid: (int(n), int(nbytes)) for cid, n, nbytes in conn.execute(
        sa.select(k.c.checkpoint_id, sa.func.sum(k.c.blocks), sa.func.sum(k.c.nbytes)).group_by(k.c.checkpoint_id))}
    ts = schema.tensor_sketch
    stored_sketches: dict[str, dict[int, tuple[bytes, bool]]] = {}
    for cid, tidx, blob, complete in conn.execute(sa.select(ts.c.checkpoint_id, ts.c.tensor_idx, ts.c.sketch,
                                                            ts.c.complete)):
        stored_sketches.setdefault(cid, {})[int(tidx)] = (bytes(blob), bool(complete))
    out = []
    for cid, name in conn.execute(sa.select(c.c.id, c.c.name).order_by(c.c.name)).all():
        summed = {tidx: (sketch.encode(hist), complete)
                  for tidx, (hist, complete) in rank_tables.tensor_sketches_from_blocks(conn, cid).items()}
        if (tensors.get(cid, {}) != blocks.get(cid, {}) or buckets.get(cid, (0, 0)) != scored_totals.get(cid, (0, 0))
                or stored_sketches.get(cid, {}) != summed):
            out.append(Finding("corrupt", f"checkpoint {name!r}: its ranking summaries (mp_rank_tensor, "
                                          f"mp_rank_bucket, mp_tensor_sketch) disagree with its blocks; re-ingest it"))
    n_ok = len(blocks) - len(out)
    return out or [Finding("ok", f"ranking summaries of {n_ok} checkpoint(s) agree with their blocks")]


def _stray_attempts(state: _State, owned: set[str]) -> list[Finding]:
    """Objects of merge attempts under the object-store outputs the catalog knows that no intent or snapshot
    owns (an attempt that lost a race, or was killed and its intent collected)."""
    from mergepipe_db.io.s3 import stray_attempts

    prefixes = {sn.out_path for sn in state.snapshots} | {it["out_path"] for it in state.intents}
    out = []
    for prefix in sorted(p for p in prefixes if is_remote(p)):
        try:
            strays = stray_attempts(prefix, owned)
        except MergePipeError as e:
            out.append(Finding("missing", f"output prefix {prefix}: cannot be listed ({e})", prefix))
            continue
        out += [Finding("leftover", f"stray objects of merge attempt {a.attempt} under {prefix}: "
                                    "`mergepipe gc --apply` removes them", str(a)) for a in strays]
    return out


def _known_parents(conn: sa.Connection) -> set[Path]:
    s, st = schema.snapshot, schema.staging
    outs = list(conn.execute(sa.select(s.c.out_path)).scalars()) + list(
        conn.execute(sa.select(st.c.out_path)).scalars())
    return {Path(o).parent for o in outs if not is_remote(o)}


def fsck(db: Database, *, full: bool = False) -> list[Finding]:
    """Cross-check catalog, manifests and files; returns findings (see the module docstring for kinds).

    Sizes (and source mtimes) are compared by default; `full` also rehashes every file (sha256). Reads the
    catalog in short transactions and looks at the files without holding it. Never raises for what it finds;
    a catalog it cannot open raises CatalogError.
    """
    from mergepipe_db.pipeline.commit import STAGING_PREFIX

    with db.connect() as conn:
        parents = _known_parents(conn)
    # Directories listed before ownership is read: a staging directory exists only once its intent does.
    dirs = sorted(p for parent in sorted(parents) if parent.is_dir() for p in parent.glob(f"{STAGING_PREFIX}*"))
    with db.connect() as conn:
        state = _read_state(conn)
        summaries = _check_summaries(conn)
    owned = {sn.staging_path for sn in state.snapshots} | {it["staging_path"] for it in state.intents}
    found = _check_refs(state) + _check_snapshots(state, full=full) + _check_intents(state)
    found += [Finding("leftover", f"stray staging directory {p}: `mergepipe gc --apply` removes it", str(p))
              for p in dirs if str(p) not in owned and p.is_dir()]
    found += _stray_attempts(state, owned)
    found += _check_sources(state, full=full) + _check_stores(state) + summaries
    # An intent that looked interrupted may belong to a merge that finished while we looked.
    if any(f.kind == "leftover" and f.text.startswith("staging ") for f in found):
        with db.connect() as conn:
            still = set(conn.execute(sa.select(schema.staging.c.staging_path)).scalars())
        found = [f for f in found if not (f.kind == "leftover" and f.text.startswith("staging ")
                                          and f.path not in still)]
    return found
