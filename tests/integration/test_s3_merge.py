"""Checkpoints in S3-compatible object storage (SeaweedFS `weed mini`, `tests/s3server.py`): ingest from
``s3://`` gives the catalog rows a local ingest gives; merges read only the planned ranges — the bytes the
server sent for the experts' objects, measured by a proxy outside the client, are the planned bytes (plus
headers) — and write the same output as the merge from local files; a replaced object is refused before
planning; ``verify --full`` rehashes remote sources; bad remote inputs are typed one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from mergepipe_db import Catalog
from mergepipe_db.db import schema
from mergepipe_db.errors import BadCheckpointError, ShardIndexError, StaleSourceError, StoreNotFoundError
from mergepipe_db.io import s3 as s3io

pytestmark = pytest.mark.catalog


@pytest.fixture(scope="module")
def s3_family(s3_server, tmp_path_factory: pytest.TempPathFactory):
    """A tiny BF16 family (base + 3 experts, sharded) on local disk and uploaded to the server:
    (family, prefix URI)."""
    import uuid

    from s3server import BUCKET, upload_dir

    from mergepipe_db.demo.family import make_family

    fam = make_family(tmp_path_factory.mktemp("s3fam"), n_experts=3, preset="tiny", dtype="bfloat16", seed=7,
                      shard_bytes=48 * 1024)
    prefix = f"s3://{BUCKET}/fam-{uuid.uuid4().hex[:10]}"
    for d in (fam.base, *fam.experts):
        upload_dir(s3_server, Path(d), f"{prefix}/{Path(d).name}")
    return fam, prefix


def _spec(fam, method: str = "ties") -> dict:
    params = {"weight": 0.5, "density": 0.6} if method == "ties" else {"weight": 0.5}
    return {"merge_method": method, "base_model": "base", "dtype": "bfloat16",
            "models": [{"model": Path(e).name, "parameters": params} for e in fam.experts]}


def _ingest(cat: Catalog, root: str, fam) -> None:
    cat.ingest(f"{root}/base", name="base")
    cat.ingest_many([f"{root}/{Path(e).name}" for e in fam.experts], base="base")


def _rows(cat: Catalog) -> tuple[list, list]:
    with cat.db.connect() as conn:
        blocks = conn.execute(sa.select(schema.block.c.checkpoint_id, schema.block.c.tensor_idx,
                                        schema.block.c.block_idx, schema.block.c.offset, schema.block.c.xxh3,
                                        schema.block.c.delta_l2).order_by("checkpoint_id", "tensor_idx", "block_idx")
                              ).all()
        files = conn.execute(sa.select(schema.source_file.c.path, schema.source_file.c.sha256,
                                       schema.source_file.c.size).order_by("path")).all()
    return [tuple(b) for b in blocks], [tuple(f) for f in files]


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".safetensors"}


def test_ingest_and_merges_from_s3_equal_local(s3_server, s3_family, s3_env, catalog: Catalog,
                                               ref_catalog: Catalog, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from s3server import CountingProxy

    monkeypatch.setattr(s3io, "PART_BYTES", 16 << 10)  # this family's tensors are small: split them too

    fam, prefix = s3_family
    _ingest(catalog, prefix, fam)
    _ingest(ref_catalog, str(Path(fam.base).parent), fam)
    s3_blocks, s3_files = _rows(catalog)
    local_blocks, local_files = _rows(ref_catalog)
    assert s3_blocks == local_blocks  # same checkpoint ids, offsets, hashes and statistics
    assert sorted(f[1:] for f in s3_files) == sorted(f[1:] for f in local_files)  # same sha256 and sizes
    assert all(f[0].startswith(prefix + "/") for f in s3_files)
    again = catalog.ingest(f"{prefix}/base", name="base")  # the same objects (size and ETag): not read again
    assert not again.created and again.bytes_read == 0

    # every request goes through a proxy that counts what the server sends
    proxy = CountingProxy(s3_server.endpoint)
    try:
        s3io.set_storage_options({"endpoint": proxy.endpoint})
        spec = _spec(fam)
        sent: dict[float, int] = {}
        for budget in (1.0, 0.1):
            proxy.reset()
            res = catalog.merge(spec, out=tmp_path / f"s3-{budget}", budget=budget, verify_reads=budget < 1)
            ref = ref_catalog.merge(spec, out=tmp_path / f"local-{budget}", budget=budget)
            assert _outputs(tmp_path / f"s3-{budget}") == _outputs(tmp_path / f"local-{budget}")
            assert res.manifest_hash == ref.manifest_hash and res.plan_hash == ref.plan_hash
            assert res.realized_bytes == res.planned_bytes
            expert_sent = sum(proxy.body_bytes(path_contains=f"/{Path(e).name}/") for e in fam.experts)
            expert_gets = [r for r in proxy.records if r["method"] == "GET" and r["range"]
                           and any(f"/{Path(e).name}/" in r["path"] for e in fam.experts)]
            headers = sum(r["head"] for r in expert_gets)
            # measured outside the client: the server sent the planned expert bytes, not one byte more
            assert res.planned_bytes <= expert_sent <= res.planned_bytes + headers
            assert expert_sent == res.planned_bytes
            sent[budget] = expert_sent
            assert proxy.max_in_flight > 1  # several ranged GETs in flight at once
            full_read = res.full_bytes
        # budget 0.1: the server sent at most a tenth of what a full read of the experts is
        assert 0 < sent[0.1] <= 0.1 * full_read and sent[0.1] < sent[1.0]
        proxy.reset()  # verify --full rehashes every remote source: each object's bytes sent once more
        assert catalog.verify(full=True) == []
        assert proxy.body_bytes() == sum(f[2] for f in s3_files)
    finally:
        proxy.close()
        s3io.set_storage_options(None)


def test_replaced_object_is_refused_before_planning(s3_server, s3_env, catalog: Catalog, tmp_path: Path) -> None:
    from s3server import get_object, put_object, upload_dir

    from mergepipe_db.demo.family import make_family

    fam = make_family(tmp_path / "fam", n_experts=1, preset="tiny", dtype="bfloat16", seed=3)
    for d in (fam.base, *fam.experts):
        upload_dir(s3_server, Path(d), f"{s3_env}/{Path(d).name}")
    _ingest(catalog, s3_env, fam)
    obj = f"{s3_env}/{Path(fam.experts[0]).name}/model.safetensors"
    data = bytearray(get_object(s3_server, obj))
    data[-1] ^= 0x01  # same size, other content: a new ETag
    put_object(s3_server, obj, bytes(data))
    before = catalog.sql("SELECT COUNT(*) FROM snapshots")[1]
    with pytest.raises(StaleSourceError, match="ETag changed"):
        catalog.merge(_spec(fam, "linear"), out=tmp_path / "out", budget=1.0)
    assert not (tmp_path / "out").exists() and catalog.sql("SELECT COUNT(*) FROM snapshots")[1] == before
    problems = catalog.verify(full=True)
    assert len(problems) == 1 and obj in problems[0] and "changed" in problems[0]


def test_bad_remote_inputs_are_typed(s3_server, s3_env, catalog: Catalog, tmp_path: Path) -> None:
    from s3server import put_object

    from mergepipe_db.demo.family import make_family

    fam = make_family(tmp_path / "fam", n_experts=1, preset="tiny", dtype="bfloat16", seed=4)
    good = (Path(fam.base) / "model.safetensors").read_bytes()
    put_object(s3_server, f"{s3_env}/notst/model.safetensors", b"this is not a safetensors file at all")
    put_object(s3_server, f"{s3_env}/trunc/model.safetensors", good[: len(good) // 2])
    put_object(s3_server, f"{s3_env}/dots/model.safetensors.index.json",
               json.dumps({"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}}).encode())
    put_object(s3_server, f"{s3_env}/abs/model.safetensors.index.json",
               json.dumps({"weight_map": {"model.embed_tokens.weight": "/etc/x.safetensors"}}).encode())
    cases = {
        "notst": BadCheckpointError, "trunc": BadCheckpointError, "dots": ShardIndexError, "abs": ShardIndexError,
        "nothing-here": BadCheckpointError,
    }
    for name, err in cases.items():
        with pytest.raises(err) as e:
            catalog.ingest(f"{s3_env}/{name}", name=name)
        assert "\n" not in str(e.value) and s3_env in str(e.value), (name, str(e.value))
    with pytest.raises(StoreNotFoundError):
        catalog.ingest("s3://no-such-bucket-xyz/fam/base", name="x")
    assert catalog.sql("SELECT COUNT(*) FROM checkpoints")[1] == [(0,)]


def test_cli_ingest_from_s3_with_storage_options_and_errors(s3_server, s3_family, s3_env, catalog_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from crashkit import cli, one_line_error

    fam, prefix = s3_family
    env = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}  # options only
    opts = ["--storage-option", f"endpoint={s3_server.endpoint}",
            "--storage-option", f"access_key_id={s3_server.env()['AWS_ACCESS_KEY_ID']}",
            "--storage-option", f"secret_access_key={s3_server.env()['AWS_SECRET_ACCESS_KEY']}"]
    r = cli(["ingest", f"{prefix}/base", "--name", "base", "--catalog", catalog_url, "--json", *opts], env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_tensors"] > 0
    bad = {
        "StorageConfigError": [f"{prefix}/base", *opts[:2]],  # no credentials
        "StoreNotFoundError": ["s3://no-such-bucket-cli/base", *opts],
    }  # (malformed URIs and unknown schemes: the same one-line path, tested in-process in tests/io)
    for err, args in bad.items():
        r = cli(["ingest", *args, "--name", "x", "--catalog", catalog_url], env=env)
        assert r.returncode == 1 and one_line_error(r.stderr, err), (err, r.stderr)
    r = cli(["sql", "SELECT COUNT(*) AS n FROM checkpoints WHERE name <> 'base'", "--catalog", catalog_url])
    assert r.returncode == 0 and r.stdout.split()[:3] == ["n", "-", "0"], r.stdout  # nothing else was written


def test_spec_names_s3_paths(s3_family, s3_env, catalog: Catalog, tmp_path: Path) -> None:
    """`base_model:`/`model:` may be s3:// URIs: they are ingested (default names: the prefixes' names), then
    merged like catalogued models."""
    fam, prefix = s3_family
    spec = {"merge_method": "linear", "base_model": f"{prefix}/base",
            "models": [{"model": f"{prefix}/{Path(e).name}", "parameters": {"weight": 0.5}} for e in fam.experts[:2]]}
    res = catalog.merge(spec, out=tmp_path / "out", budget=0.5)
    assert res.realized_bytes == res.planned_bytes > 0
    names = {r[0] for r in catalog.sql("SELECT name FROM checkpoints")[1]}
    assert {"base", Path(fam.experts[0]).name, Path(fam.experts[1]).name} <= names


def test_lora_adapter_from_s3_equals_local(s3_server, s3_env, tiny_family, catalog: Catalog, ref_catalog: Catalog,
                                           tmp_path: Path) -> None:
    """A PEFT adapter stored under a prefix is detected as one, ingested (its factors read from the store) and
    merged; the output equals the merge of the same adapter from local files."""
    from builders import lora_factors, write_adapter
    from conftest import BLOCK
    from s3server import upload_dir

    cfg, factors = lora_factors(5)
    local = write_adapter(tmp_path / "adapter", cfg, factors)
    remote = upload_dir(s3_server, local, f"{s3_env}/adapter")
    for cat, where in ((catalog, remote), (ref_catalog, str(local))):
        cat.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
        res = cat.ingest(where, name="lo", base="base")  # kind detected: a prefix with adapter_config.json
        assert res.kind == "lora"
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "lo", "parameters": {"weight": 1.0}}]}
    for budget in (1.0, 0.3):
        a = catalog.merge(spec, out=tmp_path / f"s3-{budget}", budget=budget)
        b = ref_catalog.merge(spec, out=tmp_path / f"local-{budget}", budget=budget)
        assert a.manifest_hash == b.manifest_hash and a.realized_bytes == a.planned_bytes
        assert _outputs(tmp_path / f"s3-{budget}") == _outputs(tmp_path / f"local-{budget}")
