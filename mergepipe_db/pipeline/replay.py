"""Replay: rebuild a plan from a manifest's recorded access set (no planning) and check its inputs.

The manifest names its inputs by content id and file sha256; the access set by (expert position, tensor
name, block ranges). The rebuilt plan must hash to the recorded plan hash, so the re-execution reads the same
bytes and produces the same output hashes and the same manifest hash.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from mergepipe_db.core.manifest import manifest_hash
from mergepipe_db.db import schema
from mergepipe_db.db.engine import Database
from mergepipe_db.errors import ReplayError, UnknownCheckpointError, VerifyError


def load_manifest(db: Database, source: str | Path) -> dict[str, Any]:
    """A manifest from a manifest.json (or the output directory holding one), or from the catalog by
    snapshot id, ref or snapshot checkpoint name."""
    path = Path(source)
    if path.is_dir() and (path / "manifest.json").is_file():
        path = path / "manifest.json"
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            manifest = doc["manifest"]
            recorded = doc["manifest_hash"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ReplayError(f"{path} is not a mergepipe manifest: {e}") from e
        if manifest_hash(manifest) != recorded:
            raise ReplayError(f"{path}: manifest content does not match its recorded hash (edited?)")
        return manifest
    s, c, r, m = schema.snapshot, schema.checkpoint, schema.ref, schema.manifest
    with db.connect() as conn:
        sid = conn.execute(sa.select(s.c.id).where(s.c.id == str(source))).scalar()
        if sid is None:
            sid = conn.execute(sa.select(r.c.snapshot_id).where(r.c.name == str(source))).scalar()
        if sid is None:
            sid = conn.execute(sa.select(s.c.id).join(c, c.c.id == s.c.checkpoint_id)
                               .where(c.c.name == str(source))).scalar()
        text = None if sid is None else conn.execute(sa.select(m.c.manifest).where(m.c.snapshot_id == sid)).scalar()
    if text is None:
        raise UnknownCheckpointError(f"unknown snapshot {str(source)!r}: not a snapshot id, ref, snapshot name "
                                     f"or manifest.json path")
    return json.loads(text)


def verify_outputs(manifest: dict[str, Any], out: Path) -> None:
    """Compare the output tensors at `out` with the manifest's recorded xxh3; VerifyError names each that differs."""
    from mergepipe_db.core.hashing import xxh3_hex
    from mergepipe_db.formats.hf_layout import resolve_checkpoint
    from mergepipe_db.io import open_store

    layout = resolve_checkpoint(out)
    recorded = {name: h for name, _dtype, _shape, h in manifest["outputs"]["tensors"]}
    differ: list[str] = []
    seen = set()
    with open_store(out).range_reader(random=False) as reader:
        for header in layout.files:
            for entry in header.tensors:
                seen.add(entry.name)
                got = xxh3_hex(reader.read(str(header.path), header.absolute_offset(entry), entry.nbytes))
                if recorded.get(entry.name) != got:
                    differ.append(entry.name)
    differ += sorted(set(recorded) - seen)
    if differ:
        raise VerifyError(f"{len(differ)} output tensor(s) differ from the manifest: {', '.join(map(repr, differ))}")
