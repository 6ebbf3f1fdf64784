"""`fsck`: each kind of finding, and the exit status of `mergepipe fsck` (leftovers alone exit 0)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from conftest import ingest_family
from crashkit import cli, one_line_error, write_spec

from mergepipe_db.admin.fsck import problems
from mergepipe_db.db import schema

pytestmark = pytest.mark.catalog


def _kinds(catalog, **kw) -> list[tuple[str, str | None]]:
    return sorted((f.kind, f.path) for f in catalog.fsck(**kw) if f.kind != "ok")


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_fsck_findings_and_exit_status(catalog, catalog_url, tiny_family, tmp_path) -> None:
    shutil.copytree(tiny_family.root, tmp_path / "fam")  # its own copy: a source file goes missing below
    fam = SimpleNamespace(base=tmp_path / "fam" / tiny_family.base.name,
                          experts=[tmp_path / "fam" / p.name for p in tiny_family.experts])
    names = ingest_family(catalog, fam)
    spec = write_spec(tmp_path / "spec.yml", names)
    a = Path(catalog.merge(spec, out=tmp_path / "a").out)
    b = Path(catalog.merge(spec, out=tmp_path / "b").out)
    found = catalog.fsck()
    assert found and all(f.kind == "ok" for f in found)
    assert sum("snapshot" in f.text for f in found) == 2 and sum("source file" in f.text for f in found) == 4
    r = cli(["fsck", "--json", "--catalog", catalog_url])
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, r.stderr

    # Leftovers: a stray staging directory, an intent whose process is gone, a committed unpublished output.
    stray = tmp_path / ".mergepipe-staging-x-000000000000"
    stray.mkdir()
    dead = tmp_path / ".mergepipe-staging-y-111111111111"
    dead.mkdir()
    with catalog.db.connect() as conn:
        conn.execute(schema.staging.insert().values(id="dead", staging_path=str(dead), out_path=str(tmp_path / "y"),
                                                    pid=_dead_pid(), host=socket.gethostname(), created_at="x"))
        staging_b = conn.execute(schema.snapshot.select().where(schema.snapshot.c.out_path == str(b))).one()
    os.rename(b, staging_b.staging_path)  # as if killed between the catalog commit and the rename
    assert _kinds(catalog) == sorted([("leftover", str(stray)), ("leftover", str(dead)),
                                      ("leftover", staging_b.staging_path)])
    r = cli(["fsck", "--catalog", catalog_url])
    assert r.returncode == 0 and "3 leftover(s)" in r.stdout, r.stdout + r.stderr
    assert len(catalog.gc(dry_run=False)) == 3
    assert _kinds(catalog) == [] and (b / "manifest.json").is_file() and not stray.exists() and not dead.exists()

    # Missing and corrupt: each is reported, and the CLI exits 1 with one line.
    shard = sorted(a.glob("*.safetensors"))[0]
    saved = shard.read_bytes()
    with open(shard, "r+b") as fh:  # same size, other bytes: only --full sees it
        fh.seek(len(saved) // 2)
        fh.write(bytes([saved[len(saved) // 2] ^ 1]))
    assert _kinds(catalog) == [] and _kinds(catalog, full=True) == [("corrupt", str(a))]
    os.truncate(shard, 100)
    assert _kinds(catalog) == [("missing", str(a))]
    shard.write_bytes(saved)
    doc = json.loads((b / "manifest.json").read_text())
    doc["manifest"]["seed"] += 1
    (b / "manifest.json").write_text(json.dumps(doc))
    source = sorted(fam.experts[0].glob("*.safetensors"))[0]
    copy = tmp_path / "moved.safetensors"
    shutil.move(source, copy)
    try:
        assert _kinds(catalog) == sorted([("corrupt", str(b)), ("missing", str(source))])
        r = cli(["fsck", "--catalog", catalog_url])
        assert r.returncode == 1 and one_line_error(r.stderr, "VerifyError") and "missing" in r.stdout, r.stderr
    finally:
        shutil.move(copy, source)
    shutil.rmtree(a)
    found = problems(catalog.fsck())
    assert sorted((f.kind, f.path) for f in found) == sorted([("corrupt", str(b)), ("missing", str(a))])


def test_fsck_checks_packed_block_stores(catalog, tiny_family, tmp_path) -> None:
    ingest_family(catalog, tiny_family)
    store = tmp_path / "store"
    catalog.pack("e0", store=store)
    stores = [f for f in catalog.fsck() if "packed block store" in f.text]
    assert len(stores) == 1 and stores[0].kind == "ok"
    path = Path(stores[0].path)
    os.truncate(path, path.stat().st_size // 2)
    assert _kinds(catalog) == [("missing", str(path))]
    path.unlink()
    assert _kinds(catalog) == [("missing", str(path))]


def test_an_intent_whose_pid_was_reused_is_a_leftover(catalog, tmp_path) -> None:
    """A killed merge's pid, taken by a later process, must not keep its staging alive forever."""
    staging = tmp_path / ".mergepipe-staging-z-222222222222"
    staging.mkdir()
    later = subprocess.Popen(["sleep", "60"])
    try:
        with catalog.db.connect() as conn:
            conn.execute(schema.staging.insert().values(
                id="old", staging_path=str(staging), out_path=str(tmp_path / "z"), pid=later.pid,
                host=socket.gethostname(), created_at="2020-01-01T00:00:00+00:00"))
            conn.execute(schema.staging.insert().values(
                id="live", staging_path=str(tmp_path / ".mergepipe-staging-w-3"), out_path=str(tmp_path / "w"),
                pid=os.getppid(), host=socket.gethostname(), created_at="2099-01-01T00:00:00+00:00"))
        assert _kinds(catalog) == [("leftover", str(staging))]  # the live one (started before its intent) is ok
        assert catalog.gc(dry_run=False) == [f"remove staging {staging} (merge interrupted, pid {later.pid})"]
        assert not staging.exists()
    finally:
        later.kill()
        later.wait()


def test_fsck_checks_the_ranking_summaries(catalog, tiny_family, tmp_path) -> None:
    """Summaries written at ingest and commit agree with the blocks; a block edited by hand is found."""
    names = ingest_family(catalog, tiny_family)
    catalog.merge(write_spec(tmp_path / "spec.yml", names), out=tmp_path / "a")
    found = [f for f in catalog.fsck() if "ranking summaries" in f.text]
    assert [f.kind for f in found] == ["ok"] and "of 5 checkpoint(s)" in found[0].text, found
    with catalog.db.connect() as conn:  # one candidate of e1 becomes a zero delta: no longer a candidate
        b = schema.block
        cid = conn.execute(sa.select(schema.checkpoint.c.id).where(schema.checkpoint.c.name == "e1")).scalar_one()
        row = conn.execute(sa.select(b.c.tensor_idx, b.c.block_idx).where(b.c.checkpoint_id == cid,
                                                                          b.c.delta_l2 > 0).limit(1)).one()
        conn.execute(b.update().where(b.c.checkpoint_id == cid, b.c.tensor_idx == row.tensor_idx,
                                      b.c.block_idx == row.block_idx).values(delta_l2=0.0))
    assert [(f.kind, f.text.split(":")[0]) for f in problems(catalog.fsck())] == [("corrupt", "checkpoint 'e1'")]


def test_fsck_checks_the_tensor_sketches(catalog, tiny_family, tmp_path) -> None:
    """mp_tensor_sketch holds the sum of the block sketches: a block sketch removed by hand is found."""
    ingest_family(catalog, tiny_family)
    assert not problems(catalog.fsck())
    with catalog.db.connect() as conn:
        b = schema.block
        cid = conn.execute(sa.select(schema.checkpoint.c.id).where(schema.checkpoint.c.name == "e2")).scalar_one()
        row = conn.execute(sa.select(b.c.tensor_idx, b.c.block_idx).where(
            b.c.checkpoint_id == cid, b.c.sketch.is_not(None), b.c.block_idx >= 0).limit(1)).one()
        conn.execute(b.update().where(b.c.checkpoint_id == cid, b.c.tensor_idx == row.tensor_idx,
                                      b.c.block_idx == row.block_idx).values(sketch=None))
    assert [(f.kind, f.text.split(":")[0]) for f in problems(catalog.fsck())] == [("corrupt", "checkpoint 'e2'")]
