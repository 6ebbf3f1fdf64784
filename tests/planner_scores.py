"""Block scores that stress the planner's ranking, shared by the planner tests: each case rewrites every
candidate block's delta_l2 (blocks whose delta is exactly zero stay non-candidates)."""

from __future__ import annotations

import math

import sqlalchemy as sa

from mergepipe_db.db import rank_tables

SCORES = {
    "as_ingested": None,
    # a few scores equal, NULL (no statistics), NaN and inf (sort above every number), subnormal, tiny, huge
    "special": "CASE WHEN block_idx % 7 = 0 THEN NULL WHEN block_idx % 7 = 1 THEN :nan "
               "WHEN block_idx % 7 = 2 THEN :inf WHEN block_idx % 7 = 3 THEN 5e-310 "
               "WHEN block_idx % 7 = 4 THEN 1e-200 WHEN block_idx % 7 = 5 THEN 1e250 ELSE 0.25 END",
    "all_equal": "0.5",
    "no_statistics": "NULL",
}


def set_scores(catalog, case: str, *, rewrite_summaries: bool = False) -> None:
    """Give the catalog's candidate blocks the delta_l2 of SCORES[case] (None: leave them as ingested); with
    `rewrite_summaries`, also the ranking summaries ingest keeps beside them (`rank_tables.rewrite`)."""

    expr = SCORES[case]
    if expr is None:
        return
    with catalog.db.connect() as conn:
        conn.execute(sa.text(f"UPDATE mp_block SET delta_l2 = {expr} "  # noqa: S608 (test constants)
                             "WHERE delta_l2 IS NULL OR delta_l2 <> 0"), {"nan": math.nan, "inf": math.inf})
        if rewrite_summaries:
            rank_tables.rewrite(conn, [r[0] for r in conn.execute(sa.text("SELECT id FROM mp_checkpoint"))])
        conn.commit()


def plan_each(catalog, spec: dict, budgets: list) -> list:
    """`catalog.plan(spec, budget=b)` for each of `budgets` (a Budget or a string), every plan built on one
    catalog connection: what Catalog.plan does per call (resolve the models, build the plan) without opening
    the catalog again for each budget, which is most of a small plan's time."""
    from mergepipe_db.core.spec import parse_budget
    from mergepipe_db.db.lookup import find_models
    from mergepipe_db.jobs import resolve_spec
    from mergepipe_db.pipeline.plan.build import build_plan

    s, _ = resolve_spec(spec, None, None)
    with catalog.db.connect() as conn:
        found = find_models(conn, [s.base, *(m.ref for m in s.models)])
        assert all(f is not None for f in found), found
        ids = [f[0] for f in found]
        return [build_plan(conn, s, base_id=ids[0], expert_ids=ids[1:],
                           budget_spec=parse_budget(b) if isinstance(b, str) else b) for b in budgets]
