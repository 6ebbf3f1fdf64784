"""Replay: the recorded access set re-executed without planning reproduces identical outputs and manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from builders import CASES, make_spec
from conftest import BLOCK

from mergepipe_db.errors import ReplayError, UnknownCheckpointError, VerifyError

pytestmark = pytest.mark.catalog


def _family_copy(tmp_path: Path, family) -> tuple[Path, list[Path]]:
    root = tmp_path / "fam"
    shutil.copytree(family.root, root)
    return root / "base", [root / Path(p).name for p in family.experts]


def _ingest(catalog, base: Path, experts: list[Path]) -> list[str]:
    catalog.ingest(base, name="base", block_bytes=BLOCK)
    names = []
    for i, p in enumerate(experts):
        catalog.ingest(p, name=f"e{i}", base="base")
        names.append(f"e{i}")
    return names


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("method", list(CASES))
def test_replay_reproduces_outputs_and_manifest_hash(catalog, tiny_family, tmp_path, method) -> None:
    base, experts = _family_copy(tmp_path, tiny_family)
    names = _ingest(catalog, base, experts)
    first = catalog.merge(make_spec(method, names, seed=11), out=tmp_path / "first", budget=0.3)
    again = catalog.replay(first.snapshot_id, out=tmp_path / "again", verify=True)
    assert again.manifest_hash == first.manifest_hash and again.plan_hash == first.plan_hash
    assert again.realized_bytes == first.realized_bytes
    assert _shards(tmp_path / "again") == _shards(tmp_path / "first")
    by_path = catalog.replay(tmp_path / "first" / "manifest.json", out=tmp_path / "by-path")
    assert by_path.manifest_hash == first.manifest_hash


def test_replay_refuses_changed_inputs_and_unknown_snapshots(catalog, tiny_family, tmp_path) -> None:
    base, experts = _family_copy(tmp_path, tiny_family)
    names = _ingest(catalog, base, experts)
    first = catalog.merge(make_spec("ties", names), out=tmp_path / "first", budget=1.0)
    with pytest.raises(UnknownCheckpointError):
        catalog.replay("no-such-snapshot", out=tmp_path / "x")
    # change an expert file, keep its size and mtime: the stale check passes, the read hashes do not
    shard = sorted(experts[0].glob("*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    from mergepipe_db.errors import IntegrityError

    with pytest.raises((IntegrityError, ReplayError)):
        catalog.replay(first.snapshot_id, out=tmp_path / "y")
    assert not (tmp_path / "y").exists()
    # a tampered manifest file is refused
    doc = json.loads((tmp_path / "first" / "manifest.json").read_text())
    doc["manifest"]["seed"] = 999
    bad = tmp_path / "bad-manifest.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReplayError):
        catalog.replay(bad, out=tmp_path / "z")


def test_replay_verify_names_differing_tensors(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    from mergepipe_db.pipeline import replay as rp

    base, experts = _family_copy(tmp_path, tiny_family)
    names = _ingest(catalog, base, experts)
    first = catalog.merge(make_spec("linear", names), out=tmp_path / "first", budget=1.0)
    manifest = rp.load_manifest(catalog.db, first.snapshot_id)
    manifest["outputs"]["tensors"][0][3] = "0" * 32
    with pytest.raises(VerifyError, match=manifest["outputs"]["tensors"][0][0].replace(".", r"\.")):
        rp.verify_outputs(manifest, tmp_path / "first")
