"""A budget that takes every candidate reads a tensor whose every block is a candidate as one whole-tensor unit
(ranking.whole_tensors): the same bytes, access mask and plan hash as its block reads, the same output byte for
byte, and a whole-tensor hash check under --verify-reads. A tensor with a block that is not a candidate (zero
delta) keeps its block reads and never reads that block."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa
from builders import make_spec, plan_state
from conftest import ingest_family

from mergepipe_db.db import rank_tables
from mergepipe_db.errors import IntegrityError
from mergepipe_db.pipeline.plan import ranking

pytestmark = pytest.mark.catalog


def _block_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranking, "whole_tensors", lambda *a: None)


@pytest.mark.parametrize("method", ["linear", "ties", "dare_linear"])
def test_full_budget_reads_whole_tensors_with_the_same_plan(catalog, tiny_family, monkeypatch, method) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec(method, names)
    plan = catalog.plan(spec, budget="1.0")
    whole = [(key, reads) for key, reads in plan.access.items() if reads[0].block_idx == -1]
    assert whole, "some tensor is read whole"
    for (pos, tidx), reads in whole:
        name = next(t.name for t in plan.base_tensors if t.idx == tidx)
        et = plan.experts[pos].tensors[name]
        assert len(reads) == 1 and (reads[0].offset, reads[0].nbytes, reads[0].xxh3) == (et.offset, et.nbytes,
                                                                                           et.xxh3)
        assert plan.full_selection[(pos, tidx)]
    with monkeypatch.context() as m:
        _block_level(m)
        blocks = catalog.plan(spec, budget="1.0")
    assert all(r.block_idx != -1 for reads in blocks.access.values() for r in reads)
    assert plan_state(plan) == plan_state(blocks)  # hash, byte ranges, summary, bounds
    assert plan.access_mask() == blocks.access_mask()
    for key in blocks.access:
        assert plan.selected_blocks(*key) == tuple(r.block_idx for r in blocks.access[key])


def test_full_budget_output_is_the_same_byte_for_byte(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("ties", names)
    fast = catalog.merge(spec, out=tmp_path / "whole", budget="1.0", ref="a")
    with monkeypatch.context() as m:
        _block_level(m)
        slow = catalog.merge(spec, out=tmp_path / "blocks", budget="1.0", ref="b")
    assert fast.realized_bytes == slow.realized_bytes == fast.planned_bytes
    assert fast.plan_hash == slow.plan_hash
    shards = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert shards
    for name in shards:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "blocks" / name).read_bytes()
    # the recorded read counts per tensor are those of the block reads
    with catalog.db.connect() as conn:
        rows = {sid: conn.execute(sa.text(
            "SELECT tensor_idx, position, blocks_read, bytes_planned, bytes_read FROM mp_read "
            "WHERE snapshot_id = :s ORDER BY tensor_idx, position"), {"s": sid}).all()
            for sid in (fast.snapshot_id, slow.snapshot_id)}
    assert rows[fast.snapshot_id] == rows[slow.snapshot_id]


def test_a_tensor_with_a_zero_delta_block_keeps_its_block_reads(catalog, tiny_family) -> None:
    names = ingest_family(catalog, tiny_family)
    plan = catalog.plan(make_spec("linear", names), budget="1.0")
    (pos, tidx), reads = next((k, r) for k, r in sorted(plan.access.items())
                              if r[0].block_idx == -1 and plan.selected_blocks(*k)[-1] >= 1)
    e = plan.experts[pos]
    et = e.tensors[next(t.name for t in plan.base_tensors if t.idx == tidx)]
    with catalog.db.connect() as conn:  # as if block 1's bytes equalled the base's
        zeroed = conn.execute(sa.text("SELECT nbytes FROM mp_block WHERE checkpoint_id = :c AND tensor_idx = :t "
                                      "AND block_idx = 1"), {"c": e.checkpoint.id, "t": et.idx}).scalar_one()
        conn.execute(sa.text("UPDATE mp_block SET delta_l2 = 0 WHERE checkpoint_id = :c AND tensor_idx = :t "
                             "AND block_idx = 1"), {"c": e.checkpoint.id, "t": et.idx})
        rank_tables.rewrite(conn, [e.checkpoint.id])
    again = catalog.plan(make_spec("linear", names), budget="1.0")
    got = again.access[(pos, tidx)]
    assert [r.block_idx for r in got] == [b for b in range(et.n_blocks) if b != 1]
    assert not any(r.block_idx == -1 for r in got)
    assert again.planned_bytes == plan.planned_bytes - zeroed
    assert again.budget_bytes >= again.full_bytes  # still a budget that takes everything


def test_verify_reads_checks_a_whole_tensor_read(catalog, tiny_family, tmp_path) -> None:
    fam = tmp_path / "fam"
    shutil.copytree(tiny_family.root, fam)
    catalog.ingest(fam / tiny_family.base.name, name="base", block_bytes=4096)
    names = []
    for i, p in enumerate(tiny_family.experts):
        catalog.ingest(fam / p.name, name=f"e{i}", base="base")
        names.append(f"e{i}")
    spec = make_spec("linear", names)
    plan = catalog.plan(spec, budget="1.0")
    (pos, tidx), reads = max(((k, r) for k, r in plan.access.items() if r[0].block_idx == -1),
                             key=lambda kr: kr[1][0].nbytes)
    et = plan.experts[pos].tensors[next(t.name for t in plan.base_tensors if t.idx == tidx)]
    path = Path(et.path)
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(et.offset + et.nbytes - 1)
        byte = fh.read(1)
        fh.seek(et.offset + et.nbytes - 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match=f"tensor {et.name!r}, whole tensor"):
        catalog.merge(spec, out=tmp_path / "out", verify_reads=True)
    assert not (tmp_path / "out").exists()


def test_when_take_all_fails_every_candidate_is_ranked_whole_tensors_included(catalog, tiny_family,
                                                                              monkeypatch) -> None:
    """take_all refuses (a read cost above the budget): the pairs taken whole go back to the ranking."""
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("linear", names)
    whole = catalog.plan(spec, budget="1.0")
    with monkeypatch.context() as m:
        m.setattr(ranking, "take_all", lambda *a: None)
        ranked = catalog.plan(spec, budget="1.0")
    assert all(r.block_idx >= 0 for reads in ranked.access.values() for r in reads)
    assert plan_state(ranked) == plan_state(whole)
    assert ranked.planned_bytes == whole.planned_bytes == whole.candidate_bytes
