"""Catalog and ingest: schema/migrations, rows, idempotence, stale detection, coordinates, transactions.

Runs on DuckDB, or on PostgreSQL when MERGEPIPE_TEST_CATALOG is set (see conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa
import xxhash
from conftest import BLOCK, ingest_family

from mergepipe_db import Catalog
from mergepipe_db.db import schema
from mergepipe_db.errors import (
    CatalogOutOfDateError,
    CoordinateMismatchError,
    DuplicateNameError,
    StaleSourceError,
    UnknownCheckpointError,
)

pytestmark = pytest.mark.catalog


def _count(catalog: Catalog, table: sa.Table) -> int:
    with catalog.db.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def _snapshot_of_tables(catalog: Catalog) -> dict[str, int]:
    return {t.name: _count(catalog, t) for t in schema.metadata.sorted_tables}


def test_migrations_have_one_head_and_match_the_schema(catalog: Catalog) -> None:
    assert catalog.db.head_revision() == "0006"
    with catalog.db.connect() as conn:
        for table in schema.metadata.sorted_tables:
            types = dict(conn.execute(sa.text(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = :t AND table_schema = current_schema()"), {"t": table.name}).all())
            assert set(types) == {c.name for c in table.columns}, (
                f"table {table.name} differs from mergepipe_db/db/schema.py; write a new Alembic revision "
                f"(migrations/versions) that brings it in line")
            for c in table.columns:  # statistics keep all 64 bits on both backends (DuckDB's FLOAT is 4 bytes)
                if isinstance(c.type, sa.Float):
                    assert types[c.name].lower() in ("double", "double precision"), (table.name, c.name)
        views = {r[0] for r in conn.execute(sa.text(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_type = 'VIEW' AND table_schema = current_schema()"))}
    assert {"checkpoints", "files", "tensors", "blocks", "snapshots", "lineage", "reads", "refs"} <= views


def _block_l2(catalog: Catalog, *, check_schema: bool = True) -> list[float]:
    with catalog.db.connect(check_schema=check_schema) as conn:
        return [r[0] for r in conn.execute(sa.text(
            "SELECT delta_l2 FROM mp_block WHERE delta_l2 > 0 ORDER BY checkpoint_id, tensor_idx, block_idx"))]


def test_block_statistics_keep_float64_and_0005_widens_an_older_duckdb_catalog(catalog: Catalog,
                                                                                 tiny_family) -> None:
    """The float64 norms ingest computes are stored whole on both backends (DuckDB's FLOAT would round them to
    float32, and near-equal norms would then tie there but not on PostgreSQL); a 0004 DuckDB catalog's FLOAT
    columns become DOUBLE with their values kept."""
    import numpy as np

    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    catalog.ingest(tiny_family.experts[0], name="e0", base="base")
    l2 = _block_l2(catalog)
    assert len(l2) > 10 and any(float(np.float32(v)) != v for v in l2)
    if not catalog.db.is_duckdb:
        return
    columns = {"mp_block": ("delta_l2", "delta_l1", "delta_max", "pos_frac"), "mp_tensor": ("delta_l2",),
               "mp_snapshot": ("bound",)}
    with catalog.db.connect(check_schema=False) as conn:  # as schema 0004 left it: 4-byte FLOAT
        for table, cols in columns.items():
            for col in cols:
                conn.execute(sa.text(f'ALTER TABLE {table} ALTER COLUMN "{col}" TYPE FLOAT'))
        conn.execute(sa.text("DROP TABLE mp_tensor_gram"))  # (added after 0005)
        conn.execute(sa.text("DROP TABLE mp_tensor_cross"))
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0004'"))
    rounded = _block_l2(catalog, check_schema=False)
    assert rounded == [float(np.float32(v)) for v in l2]
    assert catalog.db.upgrade() == ("0004", "0006")
    assert _block_l2(catalog) == rounded
    test_migrations_have_one_head_and_match_the_schema(catalog)


def test_out_of_date_catalog_is_refused_with_the_fixing_command(catalog: Catalog) -> None:
    with catalog.db.connect() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0000'"))
    with pytest.raises(CatalogOutOfDateError, match="mergepipe db upgrade"):
        Catalog.open(catalog.db.url)


def test_ingest_rows_offsets_and_hashes(catalog: Catalog, tiny_family) -> None:
    res = catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    assert res.created and res.n_tensors == 21
    with catalog.db.connect() as conn:
        files = conn.execute(sa.select(schema.source_file)).mappings().all()
        blocks = conn.execute(sa.select(schema.block, schema.source_file.c.path)
                              .join(schema.tensor, (schema.tensor.c.checkpoint_id == schema.block.c.checkpoint_id)
                                    & (schema.tensor.c.tensor_idx == schema.block.c.tensor_idx))
                              .join(schema.source_file, schema.source_file.c.id == schema.tensor.c.file_id)
                              ).mappings().all()
    assert len(files) > 1, "the fixture family is sharded"
    for b in blocks:  # the catalogued absolute offset and length address exactly the hashed bytes
        with open(b["path"], "rb") as fh:
            fh.seek(b["offset"])
            data = fh.read(b["nbytes"])
        assert xxhash.xxh3_128_hexdigest(data) == b["xxh3"]
        assert b["nbytes"] <= BLOCK or b["row_stop"] - b["row_start"] == 1
    total = sum(b["nbytes"] for b in blocks)
    assert total == res.total_bytes


def test_expert_block_statistics_match_the_data(catalog: Catalog, tiny_family) -> None:
    import torch
    from safetensors import safe_open

    ingest_family(catalog, tiny_family)
    base_tensors = {}
    from reference_merge import load_model

    base_tensors = load_model(tiny_family.base)
    expert = load_model(tiny_family.experts[0])
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT tensor, row_start, row_stop, delta_l2, delta_l1, delta_max, pos_frac FROM blocks "
            "WHERE checkpoint = :c"), {"c": "e0"}).all()
    assert rows
    zero_blocks = 0
    for name, r0, r1, l2, l1, mx, pos in rows:
        d = expert[name].float()[r0:r1] - base_tensors[name].float()[r0:r1]
        assert l2 == pytest.approx(float(torch.linalg.vector_norm(d.double())), rel=1e-6, abs=1e-12)
        assert l1 == pytest.approx(float(d.abs().double().sum()), rel=1e-6, abs=1e-12)
        assert mx == pytest.approx(float(d.abs().max()), rel=1e-6, abs=1e-12)
        assert pos == pytest.approx(float((d > 0).double().mean()), abs=1e-9)
        zero_blocks += l2 == 0
    assert zero_blocks > 0, "some blocks are byte-identical to the base"
    del safe_open


def test_ingest_is_idempotent(catalog: Catalog, tiny_family) -> None:
    ingest_family(catalog, tiny_family)
    before = _snapshot_of_tables(catalog)
    again = catalog.ingest(tiny_family.experts[0], name="e0", base="base")
    assert not again.created
    os.utime(next(Path(tiny_family.experts[0]).glob("*.safetensors")))  # touched, same content
    again = catalog.ingest(tiny_family.experts[0], name="e0", base="base")
    assert not again.created
    assert _snapshot_of_tables(catalog) == before


def test_name_conflicts(catalog: Catalog, tiny_family) -> None:
    ingest_family(catalog, tiny_family)
    before = _snapshot_of_tables(catalog)
    with pytest.raises(DuplicateNameError):
        catalog.ingest(tiny_family.experts[1], name="e0", base="base")
    with pytest.raises(DuplicateNameError):
        catalog.ingest(tiny_family.experts[1], name="another", base="base")
    with pytest.raises(UnknownCheckpointError):
        catalog.ingest(tiny_family.experts[1], name="x", base="no-such-base")
    assert _snapshot_of_tables(catalog) == before


def test_coordinate_mismatch_lists_differences_and_changes_nothing(catalog: Catalog, tiny_family, tmp_path) -> None:
    import torch
    from reference_merge import load_model
    from safetensors.torch import save_file

    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    before = _snapshot_of_tables(catalog)
    tensors = load_model(tiny_family.experts[0])
    tensors.pop("model.norm.weight")
    tensors["extra.weight"] = torch.zeros(3)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CoordinateMismatchError) as ei:
        catalog.ingest(bad, name="bad", base="base")
    msg = str(ei.value)
    assert "missing tensor 'model.norm.weight'" in msg and "extra tensor 'extra.weight'" in msg
    assert "lm_head.weight" in msg and "\n" not in msg
    assert _snapshot_of_tables(catalog) == before


def test_failed_ingest_leaves_catalog_unchanged(catalog: Catalog, tiny_family, tmp_path, monkeypatch) -> None:
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    before = _snapshot_of_tables(catalog)
    import mergepipe_db.db.bulk as bulk

    real = bulk.bulk_insert
    calls = {"n": 0}

    def failing(conn, table, rows):
        calls["n"] += 1
        if table is schema.block:
            raise RuntimeError("injected failure while inserting blocks")
        return real(conn, table, rows)

    monkeypatch.setattr("mergepipe_db.db.checkpoints.bulk_insert", failing)
    with pytest.raises(RuntimeError, match="injected"):
        catalog.ingest(tiny_family.experts[0], name="e0", base="base")
    assert calls["n"] >= 2  # files and tensors were inserted before the failure ...
    assert _snapshot_of_tables(catalog) == before  # ... and rolled back with it


def test_stale_source_is_refused_for_planning(catalog: Catalog, tiny_family, tmp_path) -> None:
    copy = tmp_path / "e0copy"
    shutil.copytree(tiny_family.experts[0], copy)
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    catalog.ingest(copy, name="e0", base="base")
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "e0", "parameters": {"weight": 1.0}}]}
    catalog.plan(spec)
    shard = sorted(copy.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(StaleSourceError, match=str(shard.name)):
        catalog.plan(spec)
    assert any("changed" in p for p in catalog.verify())
    # restore the mtime but change a byte: only the full rehash can see it
    with open(shard, "r+b") as fh:
        fh.seek(st.st_size - 1)
        last = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([last[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert catalog.verify() == []
    problems = catalog.verify(full=True)
    assert len(problems) == 1 and "sha256" in problems[0]


def test_sql_views_and_read_only(catalog: Catalog, tiny_family) -> None:
    from mergepipe_db.errors import ReadOnlySqlError

    ingest_family(catalog, tiny_family)
    cols, rows = catalog.sql("SELECT name, kind, base FROM checkpoints ORDER BY name")
    assert cols == ["name", "kind", "base"]
    assert rows == [("base", "full", None), ("e0", "full", "base"), ("e1", "full", "base"), ("e2", "full", "base")]
    _, rows = catalog.sql("SELECT COUNT(*) FROM blocks WHERE checkpoint = 'e0' AND delta_l2 > 0")
    assert rows[0][0] > 0
    before = _snapshot_of_tables(catalog)
    for bad in ("DELETE FROM mp_block", "DROP TABLE mp_block", "SELECT 1; DELETE FROM mp_block",
                "INSERT INTO mp_ref VALUES ('x', 'y', 1, 'z')", "CREATE TABLE t AS SELECT 1",
                "COPY mp_block TO '/tmp/mp_leak.csv'"):
        with pytest.raises(ReadOnlySqlError):
            catalog.sql(bad)
    assert not Path("/tmp/mp_leak.csv").exists()
    assert _snapshot_of_tables(catalog) == before


def test_hostile_names_are_opaque(catalog: Catalog, tmp_path) -> None:
    import torch
    from safetensors.torch import save_file

    names = ["a'; DROP TABLE mp_block; --", "../../etc/passwd", "select * from x", "名前 with space", 'q"uote']
    d = tmp_path / "m"
    d.mkdir()
    save_file({n: torch.ones(2, 2) for n in names}, str(d / "model.safetensors"))
    cname = "ckpt'; DROP TABLE mp_checkpoint;--"
    catalog.ingest(d, name=cname)
    with catalog.db.connect() as conn:
        got = {r[0] for r in conn.execute(sa.select(schema.tensor.c.name))}
        cnames = [r[0] for r in conn.execute(sa.select(schema.checkpoint.c.name))]
    assert got == set(names) and cnames == [cname]
    assert json.dumps(sorted(got))  # round-trips exactly


def test_schema_head_is_the_only_head_of_the_migrations() -> None:
    """`SCHEMA_HEAD` (what the code needs, checked at every open without loading alembic) is the one head
    of migrations/: a new migration must move it."""
    from alembic.script import ScriptDirectory

    from mergepipe_db.db.engine import SCHEMA_HEAD
    from mergepipe_db.db.sql_files import data_dir

    assert ScriptDirectory(str(data_dir("migrations"))).get_heads() == [SCHEMA_HEAD]
