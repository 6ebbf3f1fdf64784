"""TIES pruning: a block whose max |Δ| lies in a sketch bin below the one holding the trim threshold τ is
trimmed to zero entirely, so it is no candidate (never read, not even at full budget) and the merge stays
exact. Families here have concentrated deltas (row bands) and low densities, so blocks really are pruned."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
import torch
from builders import lora_factors, materialize_lora, write_adapter, write_delta
from conftest import BLOCK, ingest_family
from reference_merge import assert_bytes_equal, load_model, load_output, reference_merge

from mergepipe_db.core import sketch
from mergepipe_db.core.dtypes import ARITHMETIC_DTYPES
from mergepipe_db.pipeline.plan import build as planner

pytestmark = pytest.mark.catalog

PARAMS = [{"weight": 1.0, "density": 0.03}, {"weight": 0.5, "density": 0.05}, {"weight": 0.7, "density": 0.01}]


def _spec(names: list[str], params: list[dict] = PARAMS) -> dict:
    return {"merge_method": "ties", "base_model": "base", "seed": 7, "parameters": {},
            "models": [{"model": n, "parameters": dict(p)} for n, p in zip(names, params)]}


def _nonzero_blocks(catalog, plan) -> list[tuple[int, int, int, int, int, float, int]]:
    """(position, base tensor_idx, block_idx, row_start, row_stop, delta_max, nbytes) of every block with a
    nonzero delta of an arithmetic tensor."""
    base_idx = {t.name: t.idx for t in plan.base_tensors}
    out = []
    with catalog.db.connect() as conn:
        for e in plan.experts:
            rows = conn.execute(sa.text(
                "SELECT t.name, t.dtype, b.block_idx, b.row_start, b.row_stop, b.delta_max, b.nbytes, b.delta_l2 "
                "FROM mp_block b JOIN mp_tensor t ON t.checkpoint_id = b.checkpoint_id "
                "AND t.tensor_idx = b.tensor_idx WHERE b.checkpoint_id = :c"), {"c": e.checkpoint.id}).all()
            for name, dtype, bidx, r0, r1, dmax, nbytes, l2 in rows:
                if dtype in ARITHMETIC_DTYPES and l2 != 0:
                    out.append((e.position, base_idx[name], bidx, r0, r1, dmax, nbytes))
    return out


@pytest.mark.parametrize("family_name", ["tiny_family", "tiny_family_f32"])
def test_full_budget_with_pruning_is_bit_identical_to_reference(catalog, request, tmp_path, family_name,
                                                                monkeypatch) -> None:
    family = request.getfixturevalue(family_name)
    names = ingest_family(catalog, family)
    spec = _spec(names)
    plan = catalog.plan(spec, budget="1.0")
    assert plan.pruned_bytes > 0 and plan.pruned_blocks > 0
    assert plan.summary()["pruned_bytes"] == plan.pruned_bytes
    assert sum(e.pruned_bytes for e in plan.experts) == plan.pruned_bytes
    assert plan.planned_bytes == plan.candidate_bytes and all(plan.full_selection.values())
    with monkeypatch.context() as m:
        m.setattr(planner, "ties_prunable", lambda *a: False)
        unpruned = catalog.plan(spec, budget="1.0")
    assert unpruned.pruned_bytes == 0
    assert unpruned.candidate_bytes == plan.candidate_bytes + plan.pruned_bytes
    assert unpruned.full_bytes == plan.full_bytes  # the budget fraction stays relative to the naive full read

    res = catalog.merge(spec, out=tmp_path / "out", budget="1.0")
    assert res.realized_bytes == res.planned_bytes == plan.planned_bytes
    expected = reference_merge("ties", Path(family.base), [Path(p) for p in family.experts[:3]], PARAMS, seed=7,
                               expert_keys=[catalog.checkpoint_id(n) for n in names], block_bytes=BLOCK)
    assert_bytes_equal(load_output(tmp_path / "out"), expected)
    # replay rebuilds the same candidates (pruned blocks included as non-candidates) and the same output
    again = catalog.replay(tmp_path / "out", out=tmp_path / "again", verify=True)
    assert again.manifest_hash == res.manifest_hash and again.realized_bytes == res.realized_bytes


@pytest.mark.parametrize("family_name", ["tiny_family", "tiny_family_f32"])
def test_pruned_blocks_hold_only_values_below_the_topk_threshold(catalog, request, family_name) -> None:
    """Property: every block left out at full budget is pruned, and its catalog delta_max (and its true max
    |Δ|) is < τ, τ = torch.topk(|Δ|.flatten(), k).values.min() on the whole tensor (+inf for k = 0); the
    sketch bin of delta_max lies below the bin of τ."""
    family = request.getfixturevalue(family_name)
    names = ingest_family(catalog, family)
    plan = catalog.plan(_spec(names), budget="1.0")
    base = load_model(family.base)
    experts = [load_model(p) for p in family.experts[:3]]
    tensors = {t.idx: t for t in plan.base_tensors}
    selected = {(pos, tidx, r.block_idx) for (pos, tidx), reads in plan.access.items() for r in reads}
    pruned = [b for b in _nonzero_blocks(catalog, plan) if (b[0], b[1], b[2]) not in selected]
    assert len(pruned) == plan.pruned_blocks > 0
    assert sum(b[6] for b in pruned) == plan.pruned_bytes
    taus: dict[tuple[int, int], float] = {}
    for pos, tidx, _bidx, r0, r1, dmax, _nbytes in pruned:
        name = tensors[tidx].name
        delta = experts[pos][name].float() - base[name].float()
        if (pos, tidx) not in taus:
            k = int(PARAMS[pos]["density"] * delta.numel())
            taus[(pos, tidx)] = math.inf if k == 0 else float(torch.topk(delta.abs().flatten(), k).values.min())
        tau = taus[(pos, tidx)]
        rows = delta if delta.dim() <= 1 else delta[r0:r1]
        assert dmax < tau and float(rows.abs().max()) < tau, (name, pos, dmax, tau)
        if math.isfinite(tau):
            tau_bin = int(sketch.bin_index(torch.tensor([tau], dtype=torch.float32))[0])
            assert int(sketch.bin_index(torch.tensor([dmax], dtype=torch.float32))[0]) < tau_bin
    assert any(math.isinf(t) for t in taus.values()) and any(math.isfinite(t) for t in taus.values())


def test_partial_budgets_with_pruning_are_sound_and_nested(catalog, tiny_family) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = _spec(names)
    full = catalog.plan(spec, budget="1.0")
    previous: set = set()
    for frac in (0.02, 0.1, 0.3, 0.6, 1.0):
        p = catalog.plan(spec, budget=frac)
        assert p.budget_bytes == int(frac * p.full_bytes) and p.planned_bytes <= p.budget_bytes
        assert p.pruned_bytes == full.pruned_bytes
        current = {(pos, t, r.block_idx) for (pos, t), reads in p.access.items() for r in reads}
        assert previous <= current
        previous = current
    assert previous == {(pos, t, r.block_idx) for (pos, t), reads in full.access.items() for r in reads}


def test_mixed_sources_prune_full_delta_and_packed_not_lora(catalog, tiny_family_f32, tmp_path) -> None:
    fam = tiny_family_f32
    catalog.ingest(fam.base, name="base", block_bytes=BLOCK)
    base, e1 = load_model(fam.base), load_model(fam.experts[1])
    catalog.ingest(fam.experts[0], name="full0", base="base")
    dnames = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.1.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight"]
    deltas = {n: e1[n].float() - base[n].float() for n in dnames}
    write_delta(tmp_path / "d", deltas)
    catalog.ingest(tmp_path / "d", name="delta1", base="base", kind="delta")
    cfg, f = lora_factors(5, dtype=torch.float32)
    write_adapter(tmp_path / "lora", cfg, f)
    catalog.ingest(tmp_path / "lora", name="lora2", base="base")
    catalog.ingest(fam.experts[2], name="packed3", base="base")
    catalog.pack("packed3", store=tmp_path / "store")
    names = ["full0", "delta1", "lora2", "packed3"]
    params = [{"weight": 0.4, "density": 0.02}, {"weight": 0.3, "density": 0.03}, {"weight": 0.5, "density": 0.02},
              {"weight": 0.2, "density": 0.04}]
    spec = _spec(names, params)
    plan = catalog.plan(spec, budget="1.0")
    pruned = {e.checkpoint.name: e.pruned_bytes for e in plan.experts}
    assert pruned["full0"] > 0 and pruned["delta1"] > 0 and pruned["packed3"] > 0 and pruned["lora2"] == 0
    res = catalog.merge(spec, out=tmp_path / "out", budget="1.0", verify_reads=True)
    assert res.realized_bytes == res.planned_bytes == plan.planned_bytes
    expected = reference_merge(
        "ties", Path(fam.base), [Path(fam.experts[0]), Path(fam.base), Path(fam.base), Path(fam.experts[2])],
        params, seed=7, expert_keys=[catalog.checkpoint_id(n) for n in names], block_bytes=BLOCK,
        expert_deltas=[None, deltas, materialize_lora(cfg, f), None])
    assert_bytes_equal(load_output(tmp_path / "out"), expected)
    catalog.replay(tmp_path / "out", out=tmp_path / "again", verify=True)


def test_plan_json_reports_pruned_bytes(catalog, catalog_url, tiny_family, tmp_path, capsys) -> None:
    import yaml

    from mergepipe_db.cli import main

    names = ingest_family(catalog, tiny_family)
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(_spec(names)))
    assert main(["plan", str(path), "--catalog", catalog_url, "--json", "--budget", "1.0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pruned_bytes"] > 0 and doc["pruned_blocks"] > 0
    assert sum(e["pruned_bytes"] for e in doc["experts"]) == doc["pruned_bytes"]


def test_trim_bound_cases() -> None:
    h = np.zeros(sketch.NBINS, dtype=np.int64)
    h[0], h[100], h[150] = 50, 40, 10
    b, _ = sketch.locate_kth_largest(h, 5)
    assert b == 150 and planner.trim_bound(h, True, 0.05, 100) == sketch.bin_edges()[150]
    assert planner.trim_bound(h, True, 0.005, 100) == math.inf  # k = 0: everything trims
    assert planner.trim_bound(h, False, 0.05, 100) is None  # a block without a sketch
    assert planner.trim_bound(h, True, 0.05, 101) is None  # counts disagree with numel
    assert planner.trim_bound(h, True, 0.9, 100) is None  # τ = 0 (zero bin): nothing to prune
    h[sketch.LAST_BIN] = 1
    assert planner.trim_bound(h, True, 0.05, 101) is None  # huge / inf / NaN values: never pruned
    # the bound is the sketch's binning: x < edges[b] iff bin(x) < b, on the edges and their neighbours
    edges = sketch.bin_edges()
    for j in (2, 40, 150, 200):
        e = np.float32(edges[j])
        for x in (np.nextafter(e, np.float32(0)), e, np.nextafter(e, np.float32(np.inf))):
            got = int(sketch.bin_index(torch.tensor([float(x)], dtype=torch.float32))[0])
            assert (float(x) < edges[j]) == (got < j)
