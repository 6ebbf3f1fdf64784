"""Hostile input: names that look like SQL or paths are opaque keys; bad names, escaping indexes and symlinks,
pickles, and SQL that reaches for files are refused with a named one-line error, and change nothing.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from crashkit import cli, one_line_error
from safetensors.torch import load_file, save_file

from mergepipe_db.db import schema
from mergepipe_db.errors import (
    BadCheckpointError,
    BadTensorNameError,
    CatalogError,
    PickleRefusedError,
    ReadOnlySqlError,
    SafetensorsFormatError,
    ShardIndexError,
    ShardSymlinkEscapeError,
    SymlinkEscapeError,
)

pytestmark = pytest.mark.catalog

HOSTILE = [
    "a'; DROP TABLE mp_block; --", 'q"uote', "semi;colon", "SELECT * FROM blocks WHERE 1=1", "../../escape",
    "/abs/path", "a/b/c", "sp ace s", "名前.重み", "émoji 🚀 ok", "back\\slash", "%s %(x)s {0} $1 :p ?", "..", ".",
    "model.safetensors", "manifest.json", "-rf *", "<script>alert(1)</script>", "set_config(x)",
]


def _tables(catalog) -> dict[str, int]:
    with catalog.db.connect() as conn:
        return {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _hostile_family(root: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(16, 8, generator=g) for n in HOSTILE}
    expert = {n: t + 0.1 * torch.randn(16, 8, generator=g) for n, t in base.items()}
    for name, tensors in (("b", base), ("x", expert)):
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / "model.safetensors"))
    return root / "b", root / "x", base, expert


def test_hostile_names_are_opaque_keys_end_to_end(catalog, catalog_url, tmp_path) -> None:
    base_dir, expert_dir, base, expert = _hostile_family(tmp_path / "fam")
    bname, ename = "base'; DROP TABLE mp_checkpoint;--", "exp \"x\" ../名前"
    catalog.ingest(base_dir, name=bname, block_bytes=256)
    catalog.ingest(expert_dir, name=ename, base=bname)

    r = cli(["sql", "SELECT checkpoint, name FROM tensors ORDER BY checkpoint, tensor_idx", "--format", "json",
             "--catalog", catalog_url])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(x["checkpoint"], x["name"]) for x in rows} == {(c, n) for c in (bname, ename) for n in HOSTILE}
    assert len(rows) == 2 * len(HOSTILE)
    _c, found = catalog.sql("SELECT name FROM checkpoints ORDER BY name")
    assert [f[0] for f in found] == sorted([bname, ename])

    spec = {"merge_method": "task_arithmetic", "base_model": bname,
            "models": [{"model": ename, "parameters": {"weight": 0.5}}], "budget": 1.0}
    before = _tree(tmp_path)
    res = catalog.merge(spec, out=tmp_path / "merged", ref="ref'; --", shard_bytes=2048)
    out = Path(res.out)
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f.startswith("model-") and "-of-" in f for f in shards)
    assert files == sorted([*shards, "model.safetensors.index.json", "manifest.json"])
    new = {p for p in _tree(tmp_path) - before if not p.startswith("catalog.duckdb")}  # its wal and lock
    assert new == {"merged", *(f"merged/{f}" for f in files)}  # nothing written anywhere else
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(HOSTILE) and set(index["weight_map"].values()) == set(shards)
    merged = {}
    for s in shards:
        merged.update(load_file(str(out / s)))
    assert set(merged) == set(HOSTILE)
    for n in HOSTILE:
        torch.testing.assert_close(merged[n], base[n] + 0.5 * (expert[n] - base[n]), rtol=1e-6, atol=1e-6)
    _c, reads = catalog.sql("SELECT DISTINCT tensor FROM reads")
    assert {x[0] for x in reads} == set(HOSTILE)
    _c, snaps = catalog.sql("SELECT ref, checkpoint FROM snapshots")
    assert snaps == [("ref'; --", "ref'; --@1")]


def _raw_safetensors(path: Path, names: list[str]) -> Path:
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"\0" * (4 * len(names)))
    return path


BAD_NAMES = ["", "x" * 1025, "é" * 513, "nul\x00byte", "new\nline", "tab\there", "del\x7f", "\x1b[31mred", "bell\x07",
             "c1\x85"]
ESCAPING_SHARDS = ["../outside.safetensors", "/abs/outside.safetensors", "sub/model.safetensors", "..", ".",
                   "a\\b.safetensors", "nul\x00.safetensors", "", "~/outside.safetensors/.."]
BAD_INDEX_DOCS = ['{"weight_map": {"w": 5}}', "[1, 2]", "{}", '{"weight_map": {}}', "not json",
                  '{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}']


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_tensor_names_are_refused_at_ingest(catalog, tmp_path, bad) -> None:
    before = _tables(catalog)
    with pytest.raises(BadTensorNameError) as ei:
        catalog.ingest(_raw_safetensors(tmp_path / "m.safetensors", ["ok", bad]), name="m")
    assert "\n" not in str(ei.value)
    assert _tables(catalog) == before


def test_bad_names_cli_and_the_1024_byte_limit(catalog, catalog_url, tmp_path) -> None:
    r = cli(["ingest", str(_raw_safetensors(tmp_path / "bad.safetensors", ["a\x00b"])), "--catalog", catalog_url])
    assert r.returncode == 1 and one_line_error(r.stderr, "BadTensorNameError"), r.stderr
    ok = catalog.ingest(_raw_safetensors(tmp_path / "edge.safetensors", ["x" * 1024, "é" * 512]), name="edge")
    assert ok.n_tensors == 2
    for name in ("", "a\x00b", "line\nbreak", "y" * 1025, "a@1", " lead", "trail ", " "):
        with pytest.raises(BadCheckpointError, match="^checkpoint name") as ei:
            catalog.ingest(tmp_path / "edge.safetensors", name=name)
        assert "\n" not in str(ei.value)
    # '@' belongs to snapshot names (<ref>@<version>): a ref holding one is refused before anything is written
    spec = {"merge_method": "task_arithmetic", "base_model": "edge", "models": [{"model": "edge",
                                                                                 "parameters": {"weight": 1.0}}]}
    with pytest.raises(BadCheckpointError, match="'@'"):
        catalog.merge(spec, out=tmp_path / "out", ref="edge@2")
    assert not (tmp_path / "out").exists()


def _index_dir(root: Path, weight_map: dict[str, str]) -> Path:
    root.mkdir()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize("shard", ESCAPING_SHARDS)
def test_shard_names_escaping_the_directory_are_refused(catalog, tmp_path, shard) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    d = _index_dir(tmp_path / "ck", {"w": shard})
    (d / "sub").mkdir()
    save_file({"w": torch.ones(2)}, str(d / "sub" / "model.safetensors"))
    before = _tables(catalog)
    with pytest.raises(ShardIndexError):
        catalog.ingest(d, name="ck")
    assert _tables(catalog) == before


def test_index_shaped_wrong_is_refused(catalog, tmp_path) -> None:
    for i, doc in enumerate(BAD_INDEX_DOCS):
        d = tmp_path / f"ck{i}"
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(doc)
        with pytest.raises(ShardIndexError):
            catalog.ingest(d, name=f"ck{i}")


def test_symlinks_out_of_the_checkpoint_are_refused(catalog, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"w": torch.ones(2)}, str(outside / "model.safetensors"))
    (outside / "config.json").write_text("{}")

    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").symlink_to(outside / "model.safetensors")
    sharded = _index_dir(tmp_path / "sharded", {"w": "model-00001-of-00001.safetensors"})
    (sharded / "model-00001-of-00001.safetensors").symlink_to(outside / "model.safetensors")
    side = tmp_path / "side"
    side.mkdir()
    save_file({"w": torch.ones(2)}, str(side / "model.safetensors"))
    (side / "config.json").symlink_to("/etc/passwd")
    before = _tables(catalog)
    with pytest.raises(SymlinkEscapeError):
        catalog.ingest(single, name="single")
    with pytest.raises(ShardSymlinkEscapeError):
        catalog.ingest(sharded, name="sharded")
    with pytest.raises(SymlinkEscapeError):
        catalog.ingest(side, name="side")
    assert _tables(catalog) == before
    inside = tmp_path / "inside"  # a link that stays inside the directory is fine
    inside.mkdir()
    save_file({"w": torch.ones(2)}, str(inside / "real.safetensors"))
    (inside / "model.safetensors").symlink_to("real.safetensors")
    assert catalog.ingest(inside, name="inside").n_tensors == 1


class _Payload:
    """Unpickling this runs `exec`, which writes the marker file: the test fails if it ever appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_pickle_checkpoints_are_refused_and_never_unpickled(catalog, catalog_url, tmp_path) -> None:
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(marker))
    bin_file = tmp_path / "evil.bin"
    bin_file.write_bytes(payload)
    in_dir = tmp_path / "evil_dir"
    in_dir.mkdir()
    (in_dir / "pytorch_model.bin").write_bytes(payload)
    idx = _index_dir(tmp_path / "evil_index", {"w": "pytorch_model.bin"})
    (idx / "pytorch_model.bin").write_bytes(payload)
    for target in (bin_file, in_dir, idx):
        r = cli(["ingest", str(target), "--name", "evil", "--catalog", catalog_url])
        assert r.returncode == 1 and one_line_error(r.stderr, "PickleRefusedError"), r.stderr
    before = _tables(catalog)
    for suffix in (".pt", ".pth", ".ckpt", ".pkl"):
        p = tmp_path / f"evil{suffix}"
        p.write_bytes(payload)
        with pytest.raises(PickleRefusedError):
            catalog.ingest(p, name="evil")
    disguised = tmp_path / "disguised"
    disguised.mkdir()
    (disguised / "model.safetensors").write_bytes(payload)  # a pickle under a safetensors name: parsed, refused
    with pytest.raises(SafetensorsFormatError):
        catalog.ingest(disguised, name="evil")
    spec = {"merge_method": "linear", "base_model": str(in_dir), "models": [{"model": str(idx),
                                                                            "parameters": {"weight": 1}}]}
    with pytest.raises(PickleRefusedError):  # a spec naming pickle paths: ingest-on-reference refuses too
        catalog.merge(spec, out=tmp_path / "out")
    assert not marker.exists()
    assert _tables(catalog) == before and not (tmp_path / "out").exists()


DUCKDB_ESCAPES = [
    "SELECT * FROM read_csv('{secret}')", "SELECT * FROM read_csv_auto('{secret}')",
    "SELECT * FROM read_text('{secret}')", "SELECT * FROM read_blob('{secret}')",
    "SELECT * FROM read_json_auto('{secret}')", "SELECT * FROM read_parquet('{secret}')",
    "SELECT * FROM glob('{dir}/*')", "SELECT * FROM sniff_csv('{secret}')", "FROM '{secret}'",
    "COPY (SELECT 1) TO '{leak}'", "COPY mp_block TO '{leak}'", "COPY mp_block FROM '{secret}'",
    "ATTACH '{dir}/other.duckdb' AS other", "INSTALL httpfs", "LOAD httpfs", "SET enable_external_access = true",
    "PRAGMA enable_external_access", "EXPORT DATABASE '{dir}/export'", "IMPORT DATABASE '{dir}'",
    "CREATE TABLE t AS SELECT 1", "INSERT INTO mp_ref VALUES ('x', 'y', 1, 'z')", "DELETE FROM mp_block",
    "UPDATE mp_ref SET version = 9", "DROP TABLE mp_block", "SELECT 1; DELETE FROM mp_block",
    "CREATE SECRET s (TYPE s3)", "CALL pragma_version()", "CHECKPOINT", "VACUUM",
]
POSTGRES_ESCAPES = [
    "SELECT pg_read_file('{secret}')", "SELECT pg_read_binary_file('{secret}')", "SELECT * FROM pg_ls_dir('{dir}')",
    "SELECT pg_stat_file('{secret}')", "SELECT lo_import('{secret}')", "SELECT lo_export(1, '{leak}')",
    "SELECT set_config('role', current_setting('is_superuser'), true)",
    "SELECT set_config('role', session_user, true) AS r, query_to_xml('SELECT pg_read_file(''{secret}'') AS x', "
    "true, true, '') AS leak",
    "SELECT set_config('session_authorization', session_user, true), query_to_xml('SELECT 1', true, true, '')",
    "SELECT U&\"set\\005fconfig\"('role', session_user, true)",
    "SELECT (SELECT set_config('role', session_user, true)) AS r",
    "SELECT * FROM checkpoints WHERE name = set_config('role', session_user, true)",
    "SELECT query_to_xml('SELECT pg_read_file(''{secret}'')', true, true, '')",
    "SELECT * FROM ts_stat('SELECT to_tsvector(pg_read_file(''{secret}''))')",
    "EXPLAIN ANALYZE SELECT set_config('role', session_user, true)",
    "COPY (SELECT 1) TO '{leak}'", "COPY (SELECT 1) TO PROGRAM 'touch {leak}'",
    "CREATE TABLE t AS SELECT 1", "DELETE FROM mp_block", "DROP TABLE mp_block",
]


def test_sql_cannot_read_or_write_files(catalog, catalog_url, tmp_path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\nTOPSECRET,1\n")
    leak = tmp_path / "leak.csv"
    queries = DUCKDB_ESCAPES if catalog.db.is_duckdb else POSTGRES_ESCAPES
    before = _tables(catalog)
    for q in queries:
        q = q.format(secret=secret, dir=tmp_path, leak=leak)
        try:
            _cols, rows = catalog.sql(q)
        except (ReadOnlySqlError, CatalogError) as e:
            assert "\n" not in str(e) and "TOPSECRET" not in str(e), (q, e)
        else:
            raise AssertionError(f"not refused: {q!r} -> {rows!r}")
        assert not leak.exists(), q
    assert _tables(catalog) == before
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith("catalog.duckdb")} == {"secret.csv"}
    r = cli(["sql", queries[0].format(secret=secret, dir=tmp_path, leak=leak), "--catalog", catalog_url])
    assert r.returncode == 1 and one_line_error(r.stderr, "ReadOnlySqlError") and "TOPSECRET" not in r.stdout
    # Literals that merely look like the refused functions are data, not calls.
    _c, rows = catalog.sql("SELECT COUNT(*) FROM tensors WHERE name = 'set_config(''role'', x)' OR name = "
                           "'query_to_xml('")
    assert rows == [(0,)]
