"""Operators with a joint sign election (ties, dare_ties) are planned by block rows: for each (tensor, block)
either every expert's candidate block is read or none, so no expert is dropped from an element's election and
divisor while the others are kept. Budget soundness holds; full-budget exactness is tests/test_merge.py's."""

from __future__ import annotations

import pytest
from conftest import ingest_family

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

