"""Ingest of several experts in one call: the same rows as one call each, the base read once per read order,
all or nothing.

Runs on DuckDB, or on PostgreSQL when MERGEPIPE_TEST_CATALOG is set (see conftest.py); the one-at-a-time
reference catalog is on the same backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from conftest import BLOCK, cold_or_skip, pages_kept
from crashkit import cli, one_line_error
from reference_merge import load_model
from safetensors.torch import save_file

from mergepipe_db import Catalog
from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.db import schema
from mergepipe_db.errors import CoordinateMismatchError, DuplicateNameError, SpecError
from mergepipe_db.formats.hf_layout import resolve_checkpoint
from mergepipe_db.io import local as storage
from mergepipe_db.io.local import ReadAhead, memory_for_cache, page_cached
from mergepipe_db.pipeline import ingest

pytestmark = pytest.mark.catalog


def _tables(catalog: Catalog) -> dict[str, list[tuple]]:
    """Every row of every table, sorted; creation times left out (they differ between runs), and the exact
    cross products of experts ingested together (mp_tensor_cross: one at a time has none; tested in
    tests/pipeline/test_tensor_gram.py)."""
    out = {}
    with catalog.db.connect() as conn:
        for t in schema.metadata.sorted_tables:
            if t.name == "mp_tensor_cross":
                continue
            cols = [c for c in t.columns if c.name != "created_at"]
            out[t.name] = sorted((tuple(r) for r in conn.execute(sa.select(*cols))), key=repr)
    return out


def _counts(catalog: Catalog) -> dict[str, int]:
    return {name: len(rows) for name, rows in _tables(catalog).items()}


@pytest.fixture
def base_reads(monkeypatch) -> dict[str, int]:
    """Bytes ingest asks for through ReadAhead.ask (its base blocks), by path."""
    seen: dict[str, int] = {}
    real = ReadAhead.ask

    def counting(self, path, offset, length):
        seen[str(path)] = seen.get(str(path), 0) + length
        return real(self, path, offset, length)

    monkeypatch.setattr(ReadAhead, "ask", counting)
    return seen


def _base_bytes_changed(catalog: Catalog, *groups: list[str]) -> int:
    """The bytes of the base's arithmetic blocks that some expert of a group changed (its block's xxh3 is not
    the base's), summed over the groups: what a scan of each group reads of the base. A block an expert left
    as it was is not read from the base."""
    with catalog.db.connect() as conn:
        dtypes = dict(conn.execute(sa.text("SELECT name, dtype FROM tensors WHERE checkpoint = 'base'")).all())
        rows = conn.execute(sa.text("SELECT checkpoint, tensor, block_idx, nbytes, xxh3 FROM blocks")).all()
    blocks = {(t, b): (n, h) for c, t, b, n, h in rows if c == "base" and dtypes[t] in ARITHMETIC_DTYPES}
    hashes = {(c, t, b): h for c, t, b, _n, h in rows}
    total = 0
    for group in groups:
        for (t, b), (n, h) in blocks.items():
            total += n if any(hashes[(e, t, b)] != h for e in group) else 0
    return total


def _base_arithmetic_bytes(catalog: Catalog) -> int:
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text("SELECT dtype, nbytes FROM tensors WHERE checkpoint = 'base'")).all()
    return sum(n for dtype, n in rows if dtype in ARITHMETIC_DTYPES)


def _one_at_a_time(ref: Catalog, base: Path, experts: list[tuple[Path, str]], block_bytes: int | None = BLOCK
                   ) -> Catalog:
    ref.ingest(base, name="base", block_bytes=block_bytes)
    for path, name in experts:
        ref.ingest(path, name=name, base="base")
    return ref


def test_together_equals_one_at_a_time_and_reads_the_base_once(catalog, ref_catalog, tiny_family, base_reads) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    names = [f"e{i}" for i in range(len(tiny_family.experts))]
    base_reads.clear()
    results = catalog.ingest_many(tiny_family.experts, names=names, base="base")
    assert [r.name for r in results] == names and all(r.created for r in results)
    # each base block some expert changed once, for all 3; the blocks all 3 left as they were not at all
    changed_by_any = _base_bytes_changed(catalog, names)
    assert sum(base_reads.values()) == changed_by_any
    assert 0 < changed_by_any < _base_arithmetic_bytes(catalog)  # the family leaves some tensors as they were

    base_reads.clear()
    ref = _one_at_a_time(ref_catalog, tiny_family.base, list(zip(tiny_family.experts, names)))
    one_each = _base_bytes_changed(catalog, *([n] for n in names))  # once for each expert that changed it
    assert sum(base_reads.values()) == one_each > changed_by_any
    assert _tables(catalog) == _tables(ref)
    with catalog.db.connect() as conn:  # the file hashes, taken on their own thread, against hashlib's
        files = conn.execute(sa.select(schema.source_file.c.path, schema.source_file.c.sha256)).all()
    assert len(files) > len(tiny_family.experts)
    for path, sha in files:
        assert sha == hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_statistics_of_every_expert_match_the_data(catalog, tiny_family) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    names = [f"e{i}" for i in range(len(tiny_family.experts))]
    catalog.ingest_many(tiny_family.experts, names=names, base="base")
    base = load_model(tiny_family.base)
    for path, name in zip(tiny_family.experts, names):
        expert = load_model(path)
        with catalog.db.connect() as conn:
            rows = conn.execute(sa.text("SELECT tensor, row_start, row_stop, delta_l2, delta_max FROM blocks "
                                        "WHERE checkpoint = :c"), {"c": name}).all()
        assert rows
        for tensor, r0, r1, l2, mx in rows:
            d = expert[tensor].float()[r0:r1] - base[tensor].float()[r0:r1]
            assert l2 == pytest.approx(float(torch.linalg.vector_norm(d.double())), rel=1e-6, abs=1e-12)
            assert mx == pytest.approx(float(d.abs().max()), rel=1e-6, abs=1e-12)


def test_experts_saved_in_another_order_are_read_on_their_own(catalog, ref_catalog, tiny_family, tmp_path,
                                                               base_reads) -> None:
    single = tmp_path / "single"  # expert 0's tensors in one file: another read order than the sharded experts'
    single.mkdir()
    save_file(load_model(tiny_family.experts[0]), str(single / "model.safetensors"))
    shutil.copy(Path(tiny_family.experts[0]) / "config.json", single / "config.json")
    sharded = resolve_checkpoint(tiny_family.experts[1])
    assert ingest.read_order(resolve_checkpoint(single)) != ingest.read_order(sharded)
    experts = [(single, "s0"), (Path(tiny_family.experts[1]), "e1"), (Path(tiny_family.experts[2]), "e2")]

    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    base_reads.clear()
    catalog.ingest_many([p for p, _ in experts], names=[n for _, n in experts], base="base")
    assert sum(base_reads.values()) == _base_bytes_changed(catalog, ["s0"], ["e1", "e2"])  # two orders: two passes
    assert _tables(catalog) == _tables(_one_at_a_time(ref_catalog, tiny_family.base, experts))


def test_a_failure_catalogues_none_of_them(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    before = _counts(catalog)
    tensors = load_model(tiny_family.experts[2])
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CoordinateMismatchError, match="lm_head.weight"):
        catalog.ingest_many([*tiny_family.experts[:2], bad], base="base")
    assert _counts(catalog) == before
    with pytest.raises(DuplicateNameError, match="more than one"):
        catalog.ingest_many(tiny_family.experts[:2], names=["same", "same"], base="base")
    with pytest.raises(SpecError, match="one name per path"):
        catalog.ingest_many(tiny_family.experts[:2], names=["only-one"], base="base")
    assert _counts(catalog) == before

    import mergepipe_db.db.bulk as bulk

    real, calls = bulk.bulk_insert, {"blocks": 0}

    def failing(conn, table, rows):  # the second expert's block rows fail, after the first's were written
        if table is schema.block:
            calls["blocks"] += 1
            if calls["blocks"] == 2:
                raise RuntimeError("injected failure while inserting blocks")
        return real(conn, table, rows)

    monkeypatch.setattr("mergepipe_db.db.checkpoints.bulk_insert", failing)
    with pytest.raises(RuntimeError, match="injected"):
        catalog.ingest_many(tiny_family.experts, names=["e0", "e1", "e2"], base="base")
    assert calls["blocks"] == 2 and _counts(catalog) == before


def test_catalogued_ones_are_left_unchanged_and_not_read(catalog, tiny_family, base_reads) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    catalog.ingest(tiny_family.experts[0], name="e0", base="base")
    base_reads.clear()
    results = catalog.ingest_many(tiny_family.experts, names=["e0", "e1", "e2"], base="base")
    assert [r.created for r in results] == [False, True, True]
    assert results[0].bytes_read == 0
    assert sum(base_reads.values()) == _base_bytes_changed(catalog, ["e1", "e2"])
    again = catalog.ingest_many(tiny_family.experts, names=["e0", "e1", "e2"], base="base")
    assert [r.created for r in again] == [False, False, False]
    assert [r.checkpoint_id for r in again] == [r.checkpoint_id for r in results]


def test_cli_ingests_several_paths(catalog, catalog_url, tiny_family) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    before = _counts(catalog)
    r = cli(["ingest", *map(str, tiny_family.experts[:2]), "--name", "a", "--base", "base",
             "--catalog", catalog_url])
    assert r.returncode == 1 and one_line_error(r.stderr, "SpecError") and _counts(catalog) == before
    r = cli(["ingest", *map(str, tiny_family.experts), "--name", "a", "--name", "b", "--name", "c",
             "--base", "base", "--catalog", catalog_url, "--json", "-q"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["name"] for x in out] == ["a", "b", "c"] and all(x["created"] for x in out)
    r = cli(["ingest", *map(str, tiny_family.experts), "--base", "base", "--catalog", catalog_url, "-q"])
    assert r.returncode == 1 and one_line_error(r.stderr, "AlreadyCataloguedError")  # same content, other names
    r = cli(["ingest", str(tiny_family.experts[0]), "--name", "a", "--base", "base", "--catalog", catalog_url,
             "--json", "-q"])
    assert r.returncode == 0 and json.loads(r.stdout)["created"] is False  # one path: one object, as before


def test_a_spec_naming_new_paths_ingests_its_experts_together(catalog, ref_catalog, tiny_family, base_reads) -> None:
    spec = {"merge_method": "linear", "base_model": str(tiny_family.base),
            "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in tiny_family.experts]}
    plan = catalog.plan(spec)
    assert [e.checkpoint.name for e in plan.experts] == [Path(p).name for p in tiny_family.experts]
    names = [Path(p).name for p in tiny_family.experts]
    assert sum(base_reads.values()) == _base_bytes_changed(catalog, names)  # the experts' pass read the base once
    by_name = dict(spec, base_model="base", models=[{"model": e.checkpoint.name, "parameters": {"weight": 0.5}}
                                                    for e in plan.experts])
    assert catalog.plan(by_name).plan_hash == plan.plan_hash
    ref = _one_at_a_time(ref_catalog, tiny_family.base, [(Path(p), Path(p).name) for p in tiny_family.experts],
                         block_bytes=None)
    assert ref.plan(by_name).plan_hash == plan.plan_hash


def _pages_cached(path: Path) -> list[bool | None]:
    """Residency of each page of `path` (None where the kernel cannot tell)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        return [page_cached(fd, off, min(4096, size - off)) for off in range(0, size, 4096)]
    finally:
        os.close(fd)


def _pages_kept(path: Path) -> list[bool]:
    """Of each page of `path`: cached, or taken out by the kernel's own reclaim (`conftest.pages_kept`), not
    dropped by ingest."""
    kept = pages_kept(path)
    assert kept is not None  # cold_or_skip has skipped where the kernel cannot tell
    return kept


def _reads_direct(path: Path) -> bool:
    """Whether a page of `path` can be read with O_DIRECT here."""
    arr = storage.aligned_empty(storage.ALIGN)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    try:
        return os.preadv(fd, [memoryview(arr)], 0) > 0
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize(("before", "room", "direct"), [
    ("cold", None, True), ("cached", None, True), ("unknown", 1 << 62, True),
    ("cold", None, False), ("cached", None, False), ("unknown", 0, False), ("unknown", 1 << 62, False)],
    ids=["cold-dropped", "cached-kept", "unknown-not-cached", "buffered-cold-dropped", "buffered-cached-kept",
         "buffered-unknown-large-read-dropped", "buffered-unknown-kept"])
def test_ingest_leaves_the_page_cache_as_it_found_it(catalog, ref_catalog, tiny_family, tmp_path, monkeypatch,
                                                     before, room, direct) -> None:
    """Base and experts read cold leave the page cache once read; read while cached, they stay cached. With
    O_DIRECT, what was not cached is never cached, whatever the kernel can tell. Through the page cache (where
    O_DIRECT is refused), what was not cached is dropped behind the reader; where the kernel cannot tell (no
    cachestat), only a read of more than half of what the cache can take is dropped."""
    if not direct:
        monkeypatch.setenv("MERGEPIPE_NO_DIRECT_IO", "1")
    base = shutil.copytree(tiny_family.base, tmp_path / "b")
    experts = [shutil.copytree(src, tmp_path / f"x{i}") for i, src in enumerate(tiny_family.experts[:2])]
    os.sync()  # clean pages, which POSIX_FADV_DONTNEED can drop
    files = [f for d in (base, *experts) for f in sorted(Path(d).glob("*.safetensors"))]
    for f in files:
        cold_or_skip(f)
    if direct and not _reads_direct(files[0]):
        pytest.skip("this file system refuses O_DIRECT reads")
    if before == "cached":
        for f in files:
            f.read_bytes()
        assert all(page for f in files for page in _pages_kept(f))
    if before == "unknown":
        for d in (base, *experts):
            resolve_checkpoint(d)  # reads each file's header through the page cache, as ingest does first
        headers_only = [page for f in files for page in _pages_cached(f)]
        monkeypatch.setattr(storage, "page_cached", lambda fd, offset, n: None)
        monkeypatch.setattr(ingest, "memory_for_cache", lambda: room)  # 0: any read is too large to keep
    catalog.ingest(base, name="base", block_bytes=BLOCK)
    catalog.ingest_many(experts, names=["x0", "x1"], base="base")
    if before == "unknown" and direct:  # only the pages the header parser read through the cache stay cached
        cached = [page for f in files for page in _pages_cached(f)]
        assert not any(c and not h for c, h in zip(cached, headers_only)) and not all(headers_only)
        kept = [page for f in files for page in _pages_kept(f)]
        assert all(k for k, h in zip(kept, headers_only) if h)
    elif before == "cached" or room:
        assert all(page for f in files for page in _pages_kept(f))
    else:
        assert not any(page for f in files for page in _pages_cached(f))
    ref = _one_at_a_time(ref_catalog, base, [(Path(d), f"x{i}") for i, d in enumerate(experts)])
    assert _tables(catalog) == _tables(ref)  # the same rows, file hashes included


def test_memory_for_cache_is_a_byte_count_below_the_machine_s_memory() -> None:
    room = memory_for_cache()
    if room is None:
        pytest.skip("no /proc/meminfo here")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 <= room <= total


def test_experts_sharded_differently_in_one_order_are_read_together(catalog, ref_catalog, tiny_family, tmp_path,
                                                                     base_reads) -> None:
    from mergepipe_db.formats.safetensors import SafetensorsWriter

    sharded = resolve_checkpoint(tiny_family.experts[0])
    assert len(sharded.files) > 1
    single = tmp_path / "single"  # expert 0 in one file, its tensors in the sharded read order
    single.mkdir()
    entries = [(e, h) for h in sharded.files for e in h.tensors]
    with SafetensorsWriter(single / "model.safetensors", [(e.name, e.dtype, tuple(e.shape)) for e, _ in entries]) as w:
        for e, h in entries:
            with open(h.path, "rb") as fh:
                fh.seek(h.absolute_offset(e))
                w.write(e.name, fh.read(e.nbytes))
    shutil.copy(Path(tiny_family.experts[0]) / "config.json", single / "config.json")
    assert ingest.read_order(resolve_checkpoint(single)) == ingest.read_order(sharded)
    experts = [(single, "s0"), (Path(tiny_family.experts[1]), "e1")]

    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    base_reads.clear()
    catalog.ingest_many([p for p, _ in experts], names=[n for _, n in experts], base="base")
    assert sum(base_reads.values()) == _base_bytes_changed(catalog, ["s0", "e1"])  # one read order: one pass
    assert _tables(catalog) == _tables(_one_at_a_time(ref_catalog, tiny_family.base, experts))
