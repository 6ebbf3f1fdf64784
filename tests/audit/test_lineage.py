"""Lineage (two merges deep, three renderings), the audit SQL over the lineage and reads views, and
`verify` of snapshot outputs (a flipped byte is named by file and tensor; untouched snapshots pass)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ingest_family

from mergepipe_db.audit.lineage import render
from mergepipe_db.cli import main
from mergepipe_db.core.units import fmt_bytes
from mergepipe_db.errors import UnknownCheckpointError
from mergepipe_db.formats.safetensors import read_header

pytestmark = pytest.mark.catalog


def _two_levels(catalog, family, tmp_path: Path):
    names = ingest_family(catalog, family)
    gen1 = catalog.merge({"merge_method": "linear", "base_model": "base",
                          "models": [{"model": names[0], "parameters": {"weight": 0.6}},
                                     {"model": names[1], "parameters": {"weight": 0.4}}]},
                         out=tmp_path / "gen1", budget=1.0)
    gen2 = catalog.merge({"merge_method": "task_arithmetic", "base_model": "base",
                          "models": [{"model": "gen1", "parameters": {"weight": 0.5}},
                                     {"model": names[2], "parameters": {"weight": 0.5}}]},
                         out=tmp_path / "gen2", budget=0.6, shard_bytes=60_000)
    return gen1, gen2


def test_lineage_two_levels_audit_sql_and_verify(catalog, catalog_url, tiny_family, tmp_path,
                                                          capsys) -> None:
    gen1, gen2 = _two_levels(catalog, tiny_family, tmp_path)
    g = catalog.lineage("gen2")
    assert g == catalog.lineage("gen2@1") == catalog.lineage(gen2.snapshot_id)
    assert g["root"] == gen2.snapshot_id
    by_id = {n["id"]: n for n in g["nodes"]}
    assert g["nodes"][0]["id"] == gen2.snapshot_id
    assert {n["name"] for n in g["nodes"]} == {"gen2@1", "gen1@1", "base", "e0", "e1", "e2"}
    assert by_id[gen1.snapshot_id]["kind"] == "snapshot" and by_id[gen1.snapshot_id]["snapshot"]["method"] == "linear"
    edges = {(e["child_name"], e["parent_name"], e["role"], e["position"]) for e in g["edges"]}
    assert edges == {("gen1@1", "base", "base", -1), ("gen1@1", "e0", "expert", 0), ("gen1@1", "e1", "expert", 1),
                     ("gen2@1", "base", "base", -1), ("gen2@1", "gen1@1", "expert", 0),
                     ("gen2@1", "e2", "expert", 1)}
    for e in g["edges"]:
        src = gen1 if e["child"] == gen1.snapshot_id else gen2
        assert e["plan_hash"] == src.plan_hash and e["budget_bytes"] == src.budget_bytes
        # bytes read along the edge: the merge's per-expert reads (its result), or its base read
        assert e["bytes_read"] == (src.base_bytes if e["role"] == "base" else src.realized_per_expert[e["position"]])

    text = render(g, "text").splitlines()
    assert text[0].startswith("gen2@1 (snapshot") and "task_arithmetic" in text[0]
    i = next(k for k, line in enumerate(text) if "expert 0" in line and ": gen1@1" in line)
    assert f"expert 0 [read {fmt_bytes(gen2.realized_per_expert[0])}]: gen1@1" in text[i]
    nested = text[i + 1:i + 4]
    assert [re.sub(r"^[│ ]+[├└]── ", "", ln).split(" (")[0] for ln in nested] == [
        f"base [read {fmt_bytes(gen1.base_bytes)}]: base", f"expert 0 [read {fmt_bytes(gen1.realized_per_expert[0])}]"
        f": e0", f"expert 1 [read {fmt_bytes(gen1.realized_per_expert[1])}]: e1"]
    assert all(ln.startswith("│   ") for ln in nested)  # one level deeper than gen1@1
    assert any(ln.startswith(f"└── expert 1 [read {fmt_bytes(gen2.realized_per_expert[1])}]: e2") for ln in text)

    mer = render(g, "mermaid").splitlines()
    assert mer[0] == "flowchart BT"
    node_ids = set()
    edge_lines = []
    for line in mer[1:]:
        if m := re.fullmatch(r'    (n\d+)(\["[^"\n]*"\]|\(\["[^"\n]*"\]\))', line):
            node_ids.add(m.group(1))
        elif m := re.fullmatch(r'    (n\d+) -->\|"([^"\n]*)"\| (n\d+)', line):
            edge_lines.append(m.groups())
        else:
            assert re.fullmatch(r"    classDef root .*|    class n\d+ root", line), line
    assert len(node_ids) == 6 and len(edge_lines) == 6
    assert all(a in node_ids and b in node_ids for a, _label, b in edge_lines)
    labels = sorted(lab for _a, lab, _b in edge_lines)
    # edges carry what was read from that input, not the whole merge's budget and plan hash again
    want = [f"base, read {fmt_bytes(r.base_bytes)}" for r in (gen1, gen2)]
    want += [f"expert {i}, read {fmt_bytes(b)}" for r in (gen1, gen2) for i, b in enumerate(r.realized_per_expert)]
    assert labels == sorted(w.replace(" ", " ") for w in want)
    nodes = [ln for ln in mer if "snapshot " in ln]
    assert sum(f"plan {gen2.plan_hash[:8]}" in ln and "task_arithmetic" in ln for ln in nodes) == 1
    assert sum(f"plan {gen1.plan_hash[:8]}" in ln and "linear" in ln for ln in nodes) == 1

    assert json.loads(render(g, "json")) == g

    # the CLI prints the same renderings
    for fmt in ("text", "mermaid", "json"):
        assert main(["lineage", "gen2", "--format", fmt, "--catalog", catalog_url]) == 0
        assert capsys.readouterr().out.rstrip("\n") == render(g, fmt)

    # "which snapshots were built from expert e0" (directly, and through other snapshots)
    _, direct = catalog.sql("SELECT DISTINCT child FROM lineage WHERE parent = 'e0' AND role = 'expert'")
    assert direct == [("gen1@1",)]
    _, transitive = catalog.sql(
        "WITH RECURSIVE built(name) AS (SELECT child FROM lineage WHERE parent = 'e0' "
        "UNION SELECT l.child FROM lineage l JOIN built b ON l.parent = b.name) "
        "SELECT name FROM built ORDER BY name")
    assert transitive == [("gen1@1",), ("gen2@1",)]
    # "which experts contributed to tensor T of snapshot gen2@1"
    tensor = "model.layers.0.mlp.down_proj.weight"
    _, contributed = catalog.sql(
        "SELECT r.expert, r.bytes_read FROM reads r JOIN snapshots s ON s.id = r.snapshot_id "
        f"WHERE s.checkpoint = 'gen2@1' AND r.tensor = '{tensor}' AND r.bytes_read > 0 ORDER BY r.position")
    with catalog.db.connect() as conn:
        import sqlalchemy as sa

        from mergepipe_db.db import schema

        rd, t = schema.read_stat, schema.tensor
        idx = conn.execute(sa.select(t.c.tensor_idx).where(t.c.checkpoint_id == gen2.snapshot_id,
                                                           t.c.name == tensor)).scalar_one()
        expected = conn.execute(sa.select(rd.c.position, rd.c.bytes_read).where(
            rd.c.snapshot_id == gen2.snapshot_id, rd.c.tensor_idx == idx, rd.c.bytes_read > 0)
            .order_by(rd.c.position)).all()
    assert [b for _e, b in contributed] == [b for _p, b in expected]
    assert {e for e, _b in contributed} <= {"gen1@1", "e2"}


    # verify: both snapshots are intact; then a flipped byte in one of gen2's shards is named by file and tensor
    assert catalog.verify_snapshot("gen1") == [] and catalog.verify_snapshot("gen2@1") == []
    assert main(["verify", "--catalog", catalog_url]) == 0
    assert "ok:" in capsys.readouterr().out
    shards = sorted(Path(gen2.out).glob("*.safetensors"))
    assert len(shards) > 1
    shard = shards[1]
    header = read_header(shard)
    victim = max(header.tensors, key=lambda t: t.nbytes)
    data = bytearray(shard.read_bytes())
    data[header.absolute_offset(victim) + victim.nbytes // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    problems = catalog.verify_snapshot(gen2.snapshot_id)
    assert len(problems) == 2, problems  # exactly the file and the one tensor
    assert any(shard.name in p and "sha256" in p for p in problems)
    assert any(repr(victim.name) in p and shard.name in p and "xxh3" in p for p in problems)
    assert catalog.verify_snapshot("gen1") == []
    assert catalog.verify_all()[0] == problems
    for args in (["verify", "gen2"], ["verify"]):
        assert main([*args, "--catalog", catalog_url]) == 1
        cap = capsys.readouterr()
        assert victim.name in cap.out and shard.name in cap.out
        assert cap.err.count("\n") == 1 and cap.err.startswith("mergepipe: error: VerifyError"), cap.err
    assert main(["verify", "gen1@1", "--catalog", catalog_url]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main(["verify", "e0", "--catalog", catalog_url]) == 0  # an original checkpoint: its sources
    assert "checkpoint e0 (sources)" in capsys.readouterr().out

    assert catalog.lineage("e0") == {"root": catalog.checkpoint_id("e0"), "edges": [],
                                     "nodes": [{"id": catalog.checkpoint_id("e0"), "name": "e0", "kind": "full",
                                                "snapshot": None}]}
    assert main(["report", "e0", "--out", str(tmp_path / "x.html"), "--catalog", catalog_url]) == 1
    assert "not a committed merge snapshot" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_unknown_snapshot_is_one_line_exit_1(catalog, catalog_url, tmp_path, capsys) -> None:
    with pytest.raises(UnknownCheckpointError):
        catalog.lineage("no-such-snapshot")
    with pytest.raises(UnknownCheckpointError):
        catalog.verify_snapshot("no-such-snapshot")
    for args in (["lineage", "nope"], ["lineage", "nope", "--format", "mermaid"], ["verify", "nope"],
                 ["report", "nope", "--out", str(tmp_path / "r.html")]):
        assert main([*args, "--catalog", catalog_url]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mergepipe: error: UnknownCheckpointError"), err
