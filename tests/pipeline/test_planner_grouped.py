"""Operators with a joint sign election (ties, dare_ties) are planned by block rows: for each (tensor, block)
either every expert's candidate block is read or none, so no expert is dropped from an element's election and
divisor while the others are kept. Budget soundness holds; full-budget exactness is tests/pipeline/test_merge.py's."""

from __future__ import annotations

import itertools
import math

import pytest
import sqlalchemy as sa
from conftest import ingest_family
from planner_scores import SCORES, set_scores

from mergepipe_db.core.spec import Budget

pytestmark = pytest.mark.catalog


def _spec(method: str, names: list[str]) -> dict:
    return {"merge_method": method, "base_model": "base", "seed": 3, "parameters": {},
            "models": [{"model": n, "parameters": {"weight": w, "density": 0.6}}
                       for n, w in zip(names, (0.5, 0.3, 0.2, 0.4))]}


def _candidates(full_plan) -> dict[tuple[int, int], set[int]]:
    """(tensor_idx, block_idx) -> experts with a candidate there (the full-budget access set)."""
    out: dict[tuple[int, int], set[int]] = {}
    for pos, tidx in full_plan.access:
        for b in full_plan.selected_blocks(pos, tidx):  # a full budget reads some tensors whole
            out.setdefault((tidx, b), set()).add(pos)
    return out


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_partial_budgets_read_whole_block_rows(catalog, tiny_family, method) -> None:
    names = ingest_family(catalog, tiny_family)
    full = catalog.plan(_spec(method, names), budget="1.0")
    groups = _candidates(full)
    assert any(len(experts) > 1 for experts in groups.values())  # rows shared by several experts exist
    for budget in ("0.1", "0.3", "0.6"):
        plan = catalog.plan(_spec(method, names), budget=budget)
        assert 0 < plan.planned_bytes <= plan.budget_bytes
        got: dict[tuple[int, int], set[int]] = {}
        for (pos, tidx), reads in plan.access.items():
            for r in reads:
                got.setdefault((tidx, r.block_idx), set()).add(pos)
        assert got, budget
        for key, experts in got.items():
            assert experts == groups[key], (budget, key)  # all of the row's experts, or (absent) none


def test_linear_still_ranks_single_blocks(catalog, tiny_family) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = dict(_spec("ties", names), merge_method="linear")
    groups = _candidates(catalog.plan(spec, budget="1.0"))
    plan = catalog.plan(spec, budget="0.3")
    got: dict[tuple[int, int], set[int]] = {}
    for (pos, tidx), reads in plan.access.items():
        for r in reads:
            got.setdefault((tidx, r.block_idx), set()).add(pos)
    assert any(experts != groups[key] for key, experts in got.items())  # some row read for one expert only



# --- the grouped ranking against a plainly written one ------------------------------------------------------



def _units_in_rank_order(catalog, plan) -> list[tuple[tuple[int, int], int, set[int]]]:
    """Block rows ranked as docs/SEMANTICS.md says, written plainly: every expert's candidate (nonzero delta)
    of a (tensor, block), taken together; key = the sum of their scores c_k·delta_l2 (NULL ones left out;
    NULL if all are), ranked NaN first, then descending, NULL last, ties by tensor then block. Returns
    ((tensor_idx, block_idx), cost, experts) in that order. Nothing may be pruned (density 1)."""
    assert plan.pruned_blocks == 0
    base_idx = {t.name: t.idx for t in plan.base_tensors}
    with catalog.db.connect() as conn:
        tensors = conn.execute(sa.text("SELECT checkpoint_id, tensor_idx, name FROM mp_tensor")).all()
        names = {(c, t): n for c, t, n in tensors}
        rows = conn.execute(sa.text("SELECT checkpoint_id, tensor_idx, block_idx, nbytes, delta_l2 FROM mp_block "
                                    "WHERE delta_l2 IS NULL OR delta_l2 <> 0")).all()
    units: dict[tuple[int, int], list[tuple[int, int, float | None]]] = {}
    for e in plan.experts:
        coef = abs(e.coef)
        for cid, tidx, bidx, nbytes, l2 in rows:
            if cid == e.checkpoint.id and names[(cid, tidx)] in base_idx:
                key = (base_idx[names[(cid, tidx)]], bidx)
                units.setdefault(key, []).append((e.position, nbytes, None if l2 is None else coef * l2))

    def order(item):
        (tidx, bidx), members = item
        scores = [s for _p, _n, s in members if s is not None]
        key = sum(scores) if scores else None
        rank = (0, 0.0) if key is not None and math.isnan(key) else (1, -key) if key is not None else (2, 0.0)
        return (*rank, tidx, bidx)

    return [(key, sum(n for _p, n, _s in members), {p for p, _n, _s in members})
            for key, members in sorted(units.items(), key=order)]


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
@pytest.mark.parametrize("scores", list(SCORES))
def test_grouped_selection_is_the_prefix_of_the_unit_ranking(catalog, tiny_family, method, scores) -> None:
    names = ingest_family(catalog, tiny_family)
    set_scores(catalog, scores)
    spec = _spec(method, names)
    for m in spec["models"]:
        m["parameters"]["density"] = 1.0  # no TIES pruning: the plain ranking above knows nothing of it
    units = _units_in_rank_order(catalog, catalog.plan(spec, budget="1.0"))
    running = list(itertools.accumulate(cost for _k, cost, _e in units))
    budgets = sorted({b for r in running for b in (r - 1, r, r + 1) if b >= 2})
    if len(budgets) > 30:
        budgets = budgets[:: len(budgets) // 30 + 1] + budgets[-3:]
    for b in budgets:
        plan = catalog.plan(spec, budget=Budget(nbytes=b))
        want = {(p, tidx, bidx) for ((tidx, bidx), _c, experts), r in zip(units, running) if r <= b for p in experts}
        got = {(p, tidx, blk) for (p, tidx) in plan.access for blk in plan.selected_blocks(p, tidx)}
        assert got == want, b
        assert plan.planned_bytes == max([r for r in running if r <= b], default=0) <= b
        for (pos, tidx), full in plan.full_selection.items():  # the summary agrees with the reads
            candidates = sum(1 for (t, _b), _c, experts in units if t == tidx and pos in experts)
            assert full == (len(plan.selected_blocks(pos, tidx)) == candidates)
