"""Corruption and drift of source files after ingest.

- a byte flipped inside a selected expert block, mtime restored (so the size/mtime stale check passes):
  `merge --verify-reads` fails with IntegrityError naming file, tensor, block and both hashes; nothing is
  published; `verify --full` and `fsck --full` name the file;
- a truncated, replaced or deleted source: StaleSourceError before any byte is read; a replacement with the
  same size and a restored mtime is caught by `verify --full` (and by `--verify-reads` when read).

Every test works on its own copy of the family (the session fixture is shared).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash
from conftest import ingest_family
from crashkit import cli, one_line_error, staging_dirs, write_spec

from mergepipe_db.errors import IntegrityError, StaleSourceError
from mergepipe_db.io import local as storage

pytestmark = pytest.mark.catalog


@dataclass(frozen=True)
class _Family:
    base: Path
    experts: tuple[Path, ...]


def _copy(family, dest: Path) -> _Family:
    shutil.copytree(family.root, dest)
    return _Family(dest / family.base.name, tuple(dest / p.name for p in family.experts))


def _keep_stamp(path: Path):
    st = os.stat(path)
    return lambda: os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _selected_block(plan, position: int = 0):
    """(tensor info, Read) of the largest block the plan reads from expert `position`."""
    e = plan.experts[position]
    choices = [(e.tensors[t.name], r) for t in plan.base_tensors for r in plan.access.get((position, t.idx), ())
               if r.block_idx >= 0]
    return max(choices, key=lambda c: c[1].nbytes)


def _nothing_published(catalog, tmp_path: Path, out: Path) -> None:
    assert not out.exists() and staging_dirs(tmp_path) == []
    _c, rows = catalog.sql("SELECT COUNT(*) FROM snapshots")
    assert rows == [(0,)]


def test_flipped_byte_in_a_selected_block_is_caught_by_verify_reads(catalog, catalog_url, tiny_family,
                                                                   tmp_path) -> None:
    fam = _copy(tiny_family, tmp_path / "fam")
    names = ingest_family(catalog, fam)
    spec = write_spec(tmp_path / "spec.yml", names, method="task_arithmetic", budget=0.5)
    tensor, read = _selected_block(catalog.plan(spec))
    path = Path(tensor.path)
    restore = _keep_stamp(path)
    at = read.offset + read.nbytes // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))
        fh.seek(read.offset)
        corrupted = xxhash.xxh3_128_hexdigest(fh.read(read.nbytes))
    restore()
    assert catalog.verify() == []  # size and mtime as ingested: only content checks can tell

    out = tmp_path / "out"
    r = cli(["merge", str(spec), "--out", str(out), "--verify-reads", "--catalog", catalog_url, "--quiet"])
    assert r.returncode == 1 and one_line_error(r.stderr, "IntegrityError"), r.stderr
    for part in (str(path), repr(tensor.name), f"block {read.block_idx}", corrupted, read.xxh3):
        assert part in r.stderr, (part, r.stderr)
    _nothing_published(catalog, tmp_path, out)
    with pytest.raises(IntegrityError):  # the same from Python
        catalog.merge(spec, out=out, verify_reads=True)
    _nothing_published(catalog, tmp_path, out)

    problems = catalog.verify(full=True)
    assert len(problems) == 1 and str(path) in problems[0] and "sha256" in problems[0]
    assert [f.kind for f in catalog.fsck() if f.kind != "ok"] == []
    bad = [f for f in catalog.fsck(full=True) if f.kind != "ok"]
    assert [f.kind for f in bad] == ["corrupt"] and bad[0].path == str(path)
    r = cli(["fsck", "--full", "--catalog", catalog_url])
    assert r.returncode == 1 and str(path) in r.stdout and one_line_error(r.stderr, "VerifyError"), r.stderr


@pytest.mark.parametrize("change", ["truncated", "replaced", "deleted"])
def test_changed_source_is_refused_before_any_read(catalog, tiny_family, tmp_path, monkeypatch, change) -> None:
    fam = _copy(tiny_family, tmp_path / "fam")
    names = ingest_family(catalog, fam)
    spec = write_spec(tmp_path / "spec.yml", names)
    victim = sorted(fam.experts[1].glob("*.safetensors"))[0]
    if change == "truncated":
        os.truncate(victim, victim.stat().st_size - 100)
    elif change == "replaced":
        shutil.copyfile(sorted(fam.experts[2].glob("*.safetensors"))[0], victim)  # same layout, new mtime
    else:
        victim.unlink()
    reads: list[tuple[str, int]] = []
    real = storage.RangeReader.read_into
    monkeypatch.setattr(storage.RangeReader, "read_into",
                        lambda self, p, off, buf: (reads.append((p, off)), real(self, p, off, buf))[1])
    with pytest.raises(StaleSourceError) as ei:
        catalog.merge(spec, out=tmp_path / "out")
    assert str(victim) in str(ei.value) and "\n" not in str(ei.value)
    assert reads == []  # refused before the first byte of any checkpoint was read
    _nothing_published(catalog, tmp_path, tmp_path / "out")
    problems = catalog.verify()
    assert len(problems) == 1 and str(victim) in problems[0]
    kind = "missing" if change == "deleted" else "corrupt"
    assert [(f.kind, f.path) for f in catalog.fsck() if f.kind != "ok"] == [(kind, str(victim))]


def test_replaced_source_with_restored_mtime_is_caught_by_full_verify(catalog, catalog_url, tiny_family,
                                                                     tmp_path) -> None:
    fam = _copy(tiny_family, tmp_path / "fam")
    names = ingest_family(catalog, fam)
    spec = write_spec(tmp_path / "spec.yml", names, budget=1.0)
    victim = sorted(fam.experts[0].glob("*.safetensors"))[1]
    donor = fam.experts[1] / victim.name
    assert donor.stat().st_size == victim.stat().st_size and donor.read_bytes() != victim.read_bytes()
    restore = _keep_stamp(victim)
    shutil.copyfile(donor, victim)
    restore()
    assert catalog.verify() == []  # the stale check cannot see it
    r = cli(["verify", "--full", "--catalog", catalog_url])
    assert r.returncode == 1 and str(victim) in r.stdout and one_line_error(r.stderr, "VerifyError"), r.stderr
    with pytest.raises(IntegrityError) as ei:
        catalog.merge(spec, out=tmp_path / "out", verify_reads=True)
    assert str(victim) in str(ei.value)
    _nothing_published(catalog, tmp_path, tmp_path / "out")
