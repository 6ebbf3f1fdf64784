"""Full disk: a merge whose output parent is a small tmpfs runs out of space while writing a shard, the base's
side files, or the manifest. It fails with OutOfSpaceError (one line), publishes nothing, leaves the catalog
as it was and removes its staging directory (or leaves only what gc collects).

Mounting needs root (CI runs as root); the tests skip, saying why, where `mount` is not permitted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import ingest_family
from crashkit import cli, one_line_error, output_hashes, staging_dirs, write_spec

from mergepipe_db.db import schema
from mergepipe_db.errors import OutOfSpaceError

pytestmark = pytest.mark.catalog

PAGE = 4096


@contextlib.contextmanager
def small_tmpfs(where: Path, size: int) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command here")
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _pages(n: int) -> int:
    return -(-n // PAGE)


def _tables(catalog) -> dict[str, int]:
    with catalog.db.connect() as conn:
        return {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables}


@pytest.mark.parametrize("runs_out_in", ["shard", "side_files", "manifest"])
def test_out_of_space_publishes_nothing_and_keeps_the_catalog(catalog, catalog_url, tiny_family, tmp_path,
                                                              runs_out_in) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = write_spec(tmp_path / "spec.yml", names)
    ref_out = Path(catalog.merge(spec, out=tmp_path / "reference", ref="reference").out)
    reference = output_hashes(ref_out)
    shard_pages = sum(_pages(p.stat().st_size) for p in ref_out.glob("*.safetensors"))
    side_pages = sum(_pages(p.stat().st_size) for p in ref_out.iterdir()
                     if p.suffix == ".json" and p.name != "manifest.json")
    assert _pages((ref_out / "manifest.json").stat().st_size) > 1
    size = {"shard": shard_pages // 2, "side_files": shard_pages + 1,
            "manifest": shard_pages + side_pages + 1}[runs_out_in] * PAGE
    before = _tables(catalog)
    with small_tmpfs(tmp_path / "small", size) as mnt:
        out = mnt / "merged"
        with pytest.raises(OutOfSpaceError) as ei:
            catalog.merge(spec, out=out, ref="full")
        assert "\n" not in str(ei.value) and "space" in str(ei.value).lower()
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
        if runs_out_in == "shard":  # the shard writer ran out, else commit.finish_staging did
            assert "model.safetensors" in str(ei.value)
        else:
            assert str(ei.value).startswith("out of space while writing the output")
        if runs_out_in == "manifest":  # the CLI says the same in one line, exit 1
            r = cli(["merge", str(spec), "--out", str(out), "--ref", "full", "--catalog", catalog_url, "--quiet"])
            assert r.returncode == 1 and one_line_error(r.stderr, "OutOfSpaceError"), r.stderr
        assert not out.exists() and staging_dirs(mnt) == [] and list(mnt.iterdir()) == []
        assert _tables(catalog) == before
        _c, rows = catalog.sql("SELECT COUNT(*) FROM snapshots WHERE ref = 'full'")
        assert rows == [(0,)]
        assert [f for f in catalog.fsck() if f.kind != "ok"] == [] and catalog.gc(dry_run=True) == []
    res = catalog.merge(spec, out=tmp_path / "roomy", ref="full")  # with room, the same merge commits
    assert res.version == 1 and output_hashes(Path(res.out)) == reference
