"""The top-of-ranking plan (mergepipe_db/ranking.py, sql/plan_rank_top.sql) and the take-all plan
(sql/plan_take_all.sql) change nothing: every plan equals the one that ranks every candidate (sql/plan_rank.sql),
at budgets on every bucket edge and in between, with NULL, NaN, inf, subnormal, tiny, huge and all-equal scores
and unequal coefficients. And the ranking summaries they rest on (and the tensor sketches TIES plans from) agree
with the blocks, after ingest, after a merge's commit and after the migrations that write them for older
catalogs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import sqlalchemy as sa
from builders import plan_state
from conftest import ingest_family
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_scores import SCORES, plan_each, set_scores

from mergepipe_db.core import sketch
from mergepipe_db.core.spec import Budget
from mergepipe_db.db import schema
from mergepipe_db.pipeline.plan import ranking

pytestmark = pytest.mark.catalog


def _spec(method: str, names: list[str]) -> dict:
    weights = (1.0, 0.37, 2.5, 0.8)  # unequal coefficients: one expert's score order is not another's
    return {"merge_method": method, "base_model": "base", "seed": 3, "parameters": {},
            "models": [{"model": n, "parameters": {"weight": w}} for n, w in zip(names, weights)]}


class _Paths:
    """Which plan each call took: the top of the ranking, take-all, or neither (every candidate ranked)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken: list[str] = []
        rank, take_all = ranking.TopOfRanking.rank, ranking.take_all

        def spy_rank(top, conn, budget):  # noqa: ANN001, ANN202
            out = rank(top, conn, budget)
            self.taken.append("top" if out is not None else "fallback")
            return out

        def spy_take_all(conn, budget):  # noqa: ANN001, ANN202
            out = take_all(conn, budget)
            self.taken.append("all" if out is not None else "fallback")
            return out

        monkeypatch.setattr(ranking.TopOfRanking, "rank", spy_rank)
        monkeypatch.setattr(ranking, "take_all", spy_take_all)


def _ranked_everything(catalog, spec, budgets, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(ranking, "top_of_ranking", lambda *a: None)
        m.setattr(ranking, "take_all", lambda *a: None)
        return plan_each(catalog, spec, budgets)


def _scores(catalog, plan) -> list[tuple[float | None, int]]:
    """(score, read cost) of every candidate of the plan's experts."""
    coef = {e.checkpoint.id: abs(e.coef) for e in plan.experts}
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text("SELECT checkpoint_id, delta_l2, nbytes FROM mp_block "
                                    "WHERE delta_l2 IS NULL OR delta_l2 <> 0")).all()
    return [(None if l2 is None else coef[c] * l2, n) for c, l2, n in rows if c in coef]


def _budgets(scores: list[tuple[float | None, int]]) -> list[int]:
    """Running costs in score order (ties in any order), each ±1, and a few random budgets."""
    keyed = sorted(scores, key=lambda s: (s[0] is None, 0 if s[0] is None or s[0] != s[0] else 1,
                                          -(s[0] or 0.0)))
    running, out = 0, {2, 3}
    for _s, n in keyed:
        running += n
        out |= {running - 1, running, running + 1}
    rng = random.Random(0)
    out |= {rng.randrange(2, running + 2) for _ in range(10)}
    budgets = sorted(b for b in out if b >= 2)
    return budgets if len(budgets) <= 60 else budgets[:: len(budgets) // 60 + 1] + budgets[-3:]


def _bounds_agree(fast, full, scale: float) -> bool:
    """The top of the ranking sums the omitted scores as c·Σ delta_l2 − Σ selected scores: equal to the summed
    omitted scores up to rounding of sums as large as every score together (`scale`)."""
    pairs = [(fast.bound_total, full.bound_total), *((fast.bound_per_tensor[t], v)
                                                   for t, v in (full.bound_per_tensor or {}).items())]
    for a, b in pairs:
        if not (math.isfinite(a) and math.isfinite(b)):
            if repr(a) != repr(b):
                return False
        elif abs(a - b) > 1e-12 * scale + 1e-12 * abs(b):
            return False
    return True


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("scores", list(SCORES))
def test_top_of_ranking_and_take_all_keep_every_plan(catalog, tiny_family, monkeypatch, method, scores) -> None:
    names = ingest_family(catalog, tiny_family)
    set_scores(catalog, scores, rewrite_summaries=True)
    spec = _spec(method, names)
    paths = _Paths(monkeypatch)
    full = catalog.plan(spec, budget="1.0")
    assert paths.taken == ["all"]
    scored = _scores(catalog, full)
    scale = math.fsum(s for s, _n in scored if s is not None and math.isfinite(s))
    budgets = [Budget(nbytes=b) if isinstance(b, int) else b for b in [*_budgets(scored), "0.01", "0.3", "1.0"]]
    for b, got, ref in zip(budgets, plan_each(catalog, spec, budgets),
                           _ranked_everything(catalog, spec, budgets, monkeypatch)):
        assert plan_state(got) == plan_state(ref), b
        assert _bounds_agree(got, ref, scale), (b, got.bound_total, ref.bound_total)
    if scores in ("as_ingested", "all_equal"):  # scores the threshold can cut: the top was taken, and held
        assert "top" in paths.taken and "fallback" not in paths.taken, paths.taken
    if scores == "no_statistics":
        assert "top" not in paths.taken  # nothing scored: every candidate ranked


def test_operators_outside_the_top_still_plan_everything(catalog, tiny_family, monkeypatch) -> None:
    """TIES ranks block rows (grouped) and prunes: never the top of the ranking; a full budget still takes all."""
    names = ingest_family(catalog, tiny_family)
    spec = {**_spec("ties", names), "models": [{"model": n, "parameters": {"weight": 0.5, "density": 0.4}}
                                               for n in names]}
    paths = _Paths(monkeypatch)
    for b in ("0.05", "0.4", "1.0"):
        ranked = _ranked_everything(catalog, spec, [b], monkeypatch)[0]
        assert plan_state(catalog.plan(spec, budget=b)) == plan_state(ranked)
    assert paths.taken == ["all"]


def _summaries(catalog) -> tuple[list[tuple], list[tuple]]:
    with catalog.db.connect() as conn:
        t = conn.execute(sa.select(schema.rank_tensor).order_by(schema.rank_tensor.c.checkpoint_id,
                                                                schema.rank_tensor.c.tensor_idx)).all()
        b = conn.execute(sa.select(schema.rank_bucket).order_by(schema.rank_bucket.c.checkpoint_id,
                                                                schema.rank_bucket.c.bucket)).all()
    return [tuple(r) for r in t], [tuple(r) for r in b]


def _tensor_sketches(catalog) -> dict[tuple[str, int], tuple[list[int], bool]]:
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.select(schema.tensor_sketch)).all()
    return {(r.checkpoint_id, r.tensor_idx): (sketch.decode(r.sketch).tolist(), bool(r.complete)) for r in rows}


def _independent_tensor_sketches(catalog) -> dict[tuple[str, int], tuple[list[int], bool]]:
    """Per checkpoint and tensor with a block sketch: the block histograms added up one by one, and whether every
    row block has a sketch."""
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text("SELECT checkpoint_id, tensor_idx, block_idx, sketch FROM mp_block")).all()
    sums: dict = {}
    missing: set = set()
    for cid, tidx, bidx, blob in rows:
        if blob is None:
            if bidx >= 0:
                missing.add((cid, tidx))
            continue
        sums[(cid, tidx)] = sums.get((cid, tidx), 0) + sketch.decode(blob)
    return {k: (v.tolist(), k not in missing) for k, v in sums.items()}


def _independent_summaries(catalog) -> tuple[dict, dict]:
    """Per checkpoint and tensor (candidates, bytes, unscored, Σ delta_l2), and per checkpoint (scored candidates,
    their bytes, min delta_l2), from the block rows in Python."""
    with catalog.db.connect() as conn:
        rows = conn.execute(sa.text("SELECT checkpoint_id, tensor_idx, nbytes, delta_l2 FROM mp_block")).all()
    tensors: dict = {}
    per_ckpt: dict = {}
    for cid, tidx, n, l2 in rows:
        if l2 is not None and l2 == 0:
            continue
        c, nb, u, s = tensors.get((cid, tidx), (0, 0, 0, []))
        tensors[(cid, tidx)] = (c + 1, nb + n, u + (l2 is None), s if l2 is None else [*s, l2])
        if l2 is not None:
            k, kb, mn = per_ckpt.get(cid, (0, 0, math.inf))
            per_ckpt[cid] = (k + 1, kb + n, min(mn, l2))
    return tensors, per_ckpt


def test_summaries_agree_with_the_blocks_after_ingest_and_commit(catalog, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    catalog.merge(_spec("linear", names), out=str(tmp_path / "out"), budget="0.5")  # a snapshot: blocks + summaries
    tensors, buckets = _summaries(catalog)
    want_t, want_c = _independent_summaries(catalog)
    assert len({r[0] for r in tensors}) == len(names) + 2  # base, experts and the snapshot
    assert {(r[0], r[1]): r[2:5] for r in tensors} == {k: v[:3] for k, v in want_t.items()}
    for r in tensors:
        assert math.isclose(r[5] or 0.0, math.fsum(want_t[(r[0], r[1])][3]), rel_tol=1e-12)
    for cid, (n, nb, mn) in want_c.items():
        mine = [r for r in buckets if r[0] == cid]
        assert sum(r[2] for r in mine) == n and sum(r[3] for r in mine) == nb
        assert min(r[4] for r in mine) == mn
        edges = sorted(mine, key=lambda r: r[1])  # buckets are ordered ranges of delta_l2
        assert all(a[4] <= b[4] for a, b in zip(edges, edges[1:]))
    sketches = _tensor_sketches(catalog)
    assert len({k[0] for k in sketches}) == len(names) + 1  # the experts and the snapshot (a base has no Δ)
    assert all(c for _h, c in sketches.values())
    assert sketches == _independent_tensor_sketches(catalog)


def test_migration_writes_the_summaries_of_an_older_catalog(catalog, tiny_family) -> None:
    ingest_family(catalog, tiny_family)
    before = _summaries(catalog), _tensor_sketches(catalog)
    assert before[0][0] and before[0][1] and before[1]
    with catalog.db.connect(check_schema=False) as conn:  # back to 0002: no summaries, no index, no sketches
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("DROP INDEX ix_mp_block_rank"))
        for table in ("mp_rank_tensor", "mp_rank_bucket", "mp_tensor_sketch", "mp_tensor_gram", "mp_tensor_cross"):
            conn.execute(sa.text(f"DROP TABLE {table}"))
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0002'"))
    assert catalog.db.upgrade() == ("0002", "0006")
    assert (_summaries(catalog), _tensor_sketches(catalog)) == before


def test_migration_0004_writes_the_tensor_sketches_of_a_0003_catalog(catalog, tiny_family) -> None:
    ingest_family(catalog, tiny_family)
    before = _tensor_sketches(catalog)
    with catalog.db.connect(check_schema=False) as conn:
        conn.execute(sa.text("DROP TABLE mp_tensor_sketch"))
        conn.execute(sa.text("DROP TABLE mp_tensor_gram"))  # (added after 0005)
        conn.execute(sa.text("DROP TABLE mp_tensor_cross"))
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0003'"))
    assert catalog.db.upgrade() == ("0003", "0006")
    assert _tensor_sketches(catalog) == before == _independent_tensor_sketches(catalog)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.floats(min_value=0.0, allow_infinity=True),
                                    st.sampled_from([math.nan, 1e-300, 1e-290, 1e290, 0.5, 2.0])),
                          st.integers(min_value=1, max_value=1 << 20)), min_size=1, max_size=40),
       st.integers(min_value=0, max_value=1 << 24))
def test_threshold_is_the_largest_bucket_bound_past_the_budget(buckets, budget) -> None:
    lower = np.array([v for v, _n in buckets], dtype=np.float64)
    nbytes = np.array([n for _v, n in buckets], dtype=np.int64)
    t = ranking.threshold(lower, nbytes, budget)

    def at_or_above(x: float) -> int:  # NaN and inf bounds count as above every number
        return int(sum(n for v, n in buckets if not math.isfinite(v) or v >= x))

    passing = [v for v, _n in buckets if math.isfinite(v) and at_or_above(v) > budget]
    if t is None:
        special = sum(n for v, n in buckets if not math.isfinite(v))
        assert special > budget or not passing or not 1e-280 <= max(passing) <= 1e280
    else:
        assert 1e-280 <= t <= 1e280 and t == max(passing) and at_or_above(t) > budget


@settings(max_examples=500, deadline=None)
@given(st.floats(min_value=1e-280, max_value=1e280), st.floats(min_value=1e-8, max_value=1e8),
       st.integers(min_value=-64, max_value=64))
def test_index_floor_is_below_every_value_scoring_the_threshold(t, coef, ulps) -> None:
    floor = ranking.index_floor(t, coef)
    x = t / coef
    step = np.nextafter if ulps else (lambda a, _b: a)
    for _ in range(abs(ulps)):
        x = float(step(x, math.inf if ulps > 0 else 0.0))
    if coef * x >= t:  # x scores at least t, as SQL computes the score
        assert x >= floor
