"""The ranking's threshold pre-filter (sql/plan_rank.sql: only candidates with score >= T are sorted) changes
nothing: every plan equals the one ranked over all candidates (the statement with the histogram cut disabled),
at budgets on the histogram's bucket edges, with NULL, NaN, inf, subnormal and all-equal scores. Block-row
operators (ties) rank without a pre-filter (sql/plan_rank_grouped.sql; tests/pipeline/test_planner_grouped.py)."""

from __future__ import annotations

import math

import pytest
import sqlalchemy as sa
from builders import plan_state
from conftest import ingest_family
from planner_scores import SCORES, plan_each, set_scores

from mergepipe_db.core.spec import Budget
from mergepipe_db.db.sql_files import sql_text
from mergepipe_db.pipeline.plan import build as planner
from mergepipe_db.pipeline.plan import ranking

pytestmark = pytest.mark.catalog

_CUT = "WHERE cum_bytes > :budget"


def _spec(method: str, names: list[str]) -> dict:
    return {"merge_method": method, "base_model": "base", "seed": 3, "parameters": {},
            "models": [{"model": n, "parameters": {"weight": 1.0, "density": 0.6}} for n in names]}


def _unfiltered(name: str) -> str:
    text = sql_text(name)
    if name == "plan_rank":
        assert text.count(_CUT) == 1
        text = text.replace(_CUT, "WHERE 1 = 0")  # no bucket qualifies: T is NULL, every candidate is ranked
    return text


def _same_bound(a: float | None, b: float | None) -> bool:
    """Bounds are float sums whose order the database chooses (DuckDB's parallel SUM already varies it):
    equal to 1e-12, relative (the manifest keeps 9 digits); NaN and inf exactly."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return repr(a) == repr(b)
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def _edge_budgets(catalog, plan) -> list[int]:
    """Read costs at the ends of the histogram's buckets in score order (NaN/inf first, NULL last), +-1."""
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT b.checkpoint_id, b.nbytes, b.delta_l2 FROM mp_block b WHERE b.delta_l2 IS NULL "
            "OR b.delta_l2 <> 0")).all()
    coef = {e.checkpoint.id: abs(e.coef) for e in plan.experts}

    def bucket(key: float | None) -> float:
        if key is None:
            return -math.inf
        if not key <= 1e300:
            return 1e9
        return -1e9 if key < 1e-300 else math.floor(math.log(key) * 256)

    keys = sorted(((bucket(None if l2 is None else coef[c] * l2), n) for c, n, l2 in rows if c in coef),
                  key=lambda k: -k[0])
    out, running = {0, 2}, 0
    for i, (b, n) in enumerate(keys):
        running += n
        if i + 1 == len(keys) or keys[i + 1][0] != b:
            out |= {running - 1, running, running + 1}
    return sorted(v for v in out if v >= 2)  # 0 and 1 would parse as fractions; Budget(nbytes=...) is explicit


def _check_same(catalog, spec, budgets, monkeypatch) -> None:
    budgets = [Budget(nbytes=b) if isinstance(b, int) else b for b in budgets]
    fast_plans = plan_each(catalog, spec, budgets)
    with monkeypatch.context() as m:
        m.setattr(planner, "sql_text", _unfiltered)
        full_plans = plan_each(catalog, spec, budgets)
    for b, fast, full in zip(budgets, fast_plans, full_plans):
        assert plan_state(fast) == plan_state(full), b
        assert _same_bound(fast.bound_total, full.bound_total), b
        for t, v in (full.bound_per_tensor or {}).items():
            assert _same_bound(fast.bound_per_tensor[t], v), (b, t)  # type: ignore[index]


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("scores", list(SCORES))
def test_prefilter_keeps_every_plan(catalog, tiny_family, monkeypatch, method, scores) -> None:
    # this is about sql/plan_rank.sql: the top-of-ranking and take-all plans (test_planner_top.py) are off
    monkeypatch.setattr(ranking, "top_of_ranking", lambda *a: None)
    monkeypatch.setattr(ranking, "take_all", lambda *a: None)
    names = ingest_family(catalog, tiny_family)
    set_scores(catalog, scores)
    spec = _spec(method, names)
    full = catalog.plan(spec, budget="1.0")
    budgets = _edge_budgets(catalog, full)
    assert len(budgets) >= 3
    if len(budgets) > 40:
        budgets = budgets[:: len(budgets) // 40 + 1] + budgets[-3:]
    _check_same(catalog, spec, [*budgets, "0.01", "0.5", "1.0"], monkeypatch)
