"""Merge outputs in S3-compatible object storage (``--out s3://bucket/prefix``; SeaweedFS `weed mini`): shards
under keys unique to the attempt, the catalog transaction as the one point of visibility, ``manifest.json``
written last; a non-empty prefix refused before anything is written; two merges racing for one prefix end
with one committed and one typed error; kills at every commit point leave nothing visible, and `gc` removes
(or rolls forward) what they left, incomplete multipart uploads included; `fsck` checks remote outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe_db import Catalog
from mergepipe_db.errors import OutputExistsError, StorageConfigError, UnsupportedStorageError
from mergepipe_db.io import s3 as s3io

pytestmark = pytest.mark.catalog


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    from mergepipe_db.demo.family import make_family

    return make_family(tmp_path_factory.mktemp("s3out"), n_experts=2, preset="tiny", dtype="bfloat16", seed=11,
                       shard_bytes=48 * 1024)


def _spec(fam) -> dict:
    return {"merge_method": "ties", "base_model": "base", "dtype": "bfloat16",
            "models": [{"model": Path(e).name, "parameters": {"weight": 0.5, "density": 0.5}} for e in fam.experts]}


def _ingest(cat: Catalog, fam) -> None:
    cat.ingest(fam.base, name="base")
    cat.ingest_many(list(fam.experts), base="base")


def _snapshots(cat: Catalog) -> list:
    return cat.sql("SELECT out_path FROM mp_snapshot ORDER BY out_path")[1]


def test_output_to_s3_equals_local_and_manifest_comes_last(s3_server, s3_env, catalog: Catalog, fam,
                                                           tmp_path: Path) -> None:
    from s3server import CountingProxy, get_object, list_keys

    _ingest(catalog, fam)
    local = catalog.merge(_spec(fam), out=tmp_path / "local", budget=0.5, shard_bytes=60_000)
    out = f"{s3_env}/merged"
    proxy = CountingProxy(s3_server.endpoint)
    try:
        s3io.set_storage_options({"endpoint": proxy.endpoint})
        res = catalog.merge(_spec(fam), out=out, budget=0.5, shard_bytes=60_000, ref="remote")
    finally:
        proxy.close()
        s3io.set_storage_options(None)
    assert res.manifest_hash == local.manifest_hash and res.out == out
    keys = list_keys(s3_server, out)
    prefix = out.removeprefix(f"s3://{out.split('/')[2]}/")
    index = json.loads(get_object(s3_server, f"{out}/model.safetensors.index.json"))
    shard_keys = sorted(set(index["weight_map"].values()))
    local_shards = sorted(p.name for p in (tmp_path / "local").glob("*.safetensors"))
    assert len(shard_keys) == len(local_shards) > 1
    attempt = shard_keys[0].split(".")[-2]
    assert all(k.endswith(f".{attempt}.safetensors") for k in shard_keys)  # keys unique to the attempt
    for name, key in zip(local_shards, shard_keys):  # the same bytes as the local output, shard by shard
        assert get_object(s3_server, f"{out}/{key}") == (tmp_path / "local" / name).read_bytes()
    assert {f"{prefix}/{k}" for k in shard_keys} | {f"{prefix}/manifest.json",
                                                     f"{prefix}/model.safetensors.index.json"} <= set(keys)
    assert not any(".mergepipe-attempt-" in k for k in keys)  # the staged manifest is gone
    doc = json.loads(get_object(s3_server, f"{out}/manifest.json"))
    assert doc["manifest_hash"] == res.manifest_hash
    # manifest.json is the last object written, after every shard, the index and the side files
    writes = [r for r in proxy.records if r["method"] in ("PUT", "POST") and r["status"] < 300
              and "delete" not in r["query"]]  # not the removal of the staged manifest (POST ?delete)
    assert writes[-1]["path"].endswith("/merged/manifest.json")
    assert sum(r["path"].endswith("/merged/manifest.json") for r in writes) == 1
    # the catalog knows the output where it is, and checks it
    assert catalog.verify_snapshot("remote") == []
    assert [f.kind for f in catalog.fsck() if "remote@1" in f.text] == ["ok"]
    again = catalog.merge({"merge_method": "linear", "base_model": "base",
                           "models": [{"model": "remote", "parameters": {"weight": 1.0}}]},
                          out=tmp_path / "from-s3", budget=1.0)
    assert again.realized_bytes == again.planned_bytes > 0  # an S3 snapshot is an input like any other
    replayed = catalog.replay("remote", out=f"{s3_env}/replayed", verify=True, shard_bytes=60_000)  # checked
    assert replayed.manifest_hash == res.manifest_hash


def test_non_empty_prefix_is_refused_before_anything_is_written(s3_server, s3_env, catalog: Catalog, fam,
                                                                capsys) -> None:
    from s3server import list_keys, put_object

    _ingest(catalog, fam)
    out = f"{s3_env}/taken"
    put_object(s3_server, f"{out}/README.md", b"someone's")
    with pytest.raises(OutputExistsError, match="not empty"):
        catalog.merge(_spec(fam), out=out, budget=0.5)
    with pytest.raises(UnsupportedStorageError):
        catalog.merge(_spec(fam), out="gs://bucket/out", budget=0.5)
    with pytest.raises(StorageConfigError, match="malformed"):
        catalog.merge(_spec(fam), out="s3://bucket/a/../b", budget=0.5)
    with pytest.raises(StorageConfigError, match="prefix inside the bucket"):
        catalog.merge(_spec(fam), out=f"s3://{out.split('/')[2]}", budget=0.5)
    assert list_keys(s3_server, out) == [out.split("/", 3)[3] + "/README.md"]
    assert _snapshots(catalog) == [] and catalog.sql("SELECT COUNT(*) FROM mp_staging")[1] == [(0,)]


def test_two_merges_racing_for_one_prefix(s3_server, s3_env, catalog: Catalog, fam,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A and B both find the prefix empty (they looked at the same time); B then runs to its end while A is
    between its shards and its index: one committed, one typed error, and only the winner's objects stay."""
    from s3server import list_keys

    _ingest(catalog, fam)
    out = f"{s3_env}/raced"
    real_check, real_index = s3io.check_output_prefix, s3io.write_index
    outcome: dict[str, object] = {}

    def index_then_lose(staging, data):
        if "started" not in outcome:
            outcome["started"] = True
            monkeypatch.setattr(s3io, "check_output_prefix", lambda o: s3io.object_path(o))  # B looked earlier
            outcome["b"] = catalog.merge(_spec(fam), out=out, budget=0.3, ref="b")
            monkeypatch.setattr(s3io, "check_output_prefix", real_check)
        return real_index(staging, data)

    monkeypatch.setattr(s3io, "write_index", index_then_lose)
    with pytest.raises(OutputExistsError, match="taken by another merge"):
        catalog.merge(_spec(fam), out=out, budget=0.5, ref="a")
    winner = outcome["b"]
    assert [r[0] for r in _snapshots(catalog)] == [out]
    assert catalog.sql("SELECT name FROM mp_ref")[1] == [("b",)]
    keys = list_keys(s3_server, out)
    index = json.loads(s3io.store().read_small(f"{out}/model.safetensors.index.json", 1 << 20))
    attempt = next(iter(index["weight_map"].values())).split(".")[-2]
    shards = [k for k in keys if k.endswith(".safetensors")]
    assert shards and all(f".{attempt}." in k for k in shards)  # the loser removed its own shards
    assert json.loads(s3io.store().read_small(f"{out}/manifest.json", 1 << 20))["manifest_hash"] == \
        winner.manifest_hash  # type: ignore[attr-defined]
    assert [f for f in catalog.fsck() if f.kind != "ok"] == []


def test_kills_during_an_s3_merge_leave_nothing_visible(s3_server, s3_env, catalog_url: str, fam,
                                                        tmp_path: Path) -> None:
    from crashkit import cli, write_spec
    from s3server import list_keys

    cat = Catalog.open(catalog_url)
    _ingest(cat, fam)
    spec = write_spec(tmp_path / "spec.yml", [Path(e).name for e in fam.experts], budget=0.5)
    env = s3_server.env()
    for point in ("tensor_written:3", "manifest_written", "catalog_committed"):
        out = f"{s3_env}/kill-{point.split(':')[0]}"
        r = cli(["merge", str(spec), "--out", out, "--catalog", catalog_url, "--shard-size", "60000"],
                env={**env, "MERGEPIPE_FAULT": point})
        assert r.returncode == -9, (point, r.stderr)
        committed = [row for row in _snapshots(cat) if row[0] == out]
        if point != "catalog_committed":  # killed before the commit: nothing visible anywhere
            assert committed == []
            assert not any(k.endswith("/manifest.json") for k in list_keys(s3_server, out))
            assert any(f.kind == "leftover" for f in cat.fsck())
        else:  # committed, manifest.json not yet written: gc rolls it forward
            assert len(committed) == 1
            assert not any(k.endswith("/manifest.json") for k in list_keys(s3_server, out))
        actions = cat.gc(dry_run=False)
        assert actions, point
        assert [f for f in cat.fsck() if f.kind != "ok"] == [], point
        if point == "catalog_committed":
            assert cat.verify_snapshot(out.rsplit("/", 1)[1]) == []
        else:
            assert list_keys(s3_server, out) == []  # every object of the killed attempt removed


def test_gc_aborts_incomplete_multipart_uploads(s3_server, s3_env, catalog: Catalog, fam) -> None:
    _ingest(catalog, fam)
    out = f"{s3_env}/mp"
    catalog.merge(_spec(fam), out=out, budget=0.2)
    status, body = s3io.signed_request("POST", f"{out}/model-00001-of-00001.deadbeef0000.safetensors",
                                       {"uploads": ""})
    assert status == 200, body
    left = s3io.incomplete_uploads(out)
    assert len(left) == 1 and left[0][0].endswith(".deadbeef0000.safetensors")
    listed = catalog.gc()
    assert any("abort incomplete multipart upload" in a for a in listed)
    assert s3io.incomplete_uploads(out) == left  # a dry run changes nothing
    catalog.gc(dry_run=False)
    assert s3io.incomplete_uploads(out) == []


@pytest.mark.slow
def test_two_processes_racing_for_one_prefix(s3_server, s3_env, catalog_url: str, fam, tmp_path: Path) -> None:
    """The race of two real `mergepipe merge` processes started together: whichever way it goes, one
    commits and the other ends with a one-line typed error, and the prefix holds the winner's output."""
    from crashkit import one_line_error, popen_cli, write_spec

    cat = Catalog.open(catalog_url)
    _ingest(cat, fam)
    spec = write_spec(tmp_path / "spec.yml", [Path(e).name for e in fam.experts], budget=0.5)
    out = f"{s3_env}/race"
    procs = [popen_cli(["merge", str(spec), "--out", out, "--ref", f"r{i}", "--catalog", catalog_url],
                       env=s3_server.env()) for i in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(rc for rc, _err in results)
    assert codes == [0, 1], results
    loser = next(err for rc, err in results if rc == 1)
    assert one_line_error(loser, "OutputExistsError", "CommitConflictError"), loser
    assert len(_snapshots(cat)) == 1 and s3io.published(out)
    cat.gc(dry_run=False)
    assert [f for f in cat.fsck() if f.kind != "ok"] == []
