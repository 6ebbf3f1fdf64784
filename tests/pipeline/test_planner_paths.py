"""Planner fast paths: the plan hash built as text equals the hash of the canonical JSON, the DuckDB numpy
fetch and the portable fetch give the same plan, the one-statement ranking selects exactly the prefix of an
independent ranking (same tie-breaks), and Catalog.plan uses one catalog connection."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import sqlalchemy as sa
from builders import make_spec
from conftest import ingest_family

from mergepipe_db import __version__
from mergepipe_db.core.hashing import sha256_hex
from mergepipe_db.core.plan import Plan, Read, plan_hash
from mergepipe_db.db import fetch
from mergepipe_db.pipeline.plan.build import ARITHMETIC_DTYPES

pytestmark = pytest.mark.catalog


def _reference_hash(plan: Plan) -> str:
    return sha256_hex({"tool": __version__.split(".")[0], **plan.canonical()})


@pytest.mark.parametrize("method", ["linear", "ties", "dare_ties", "slerp"])
def test_plan_hash_equals_hash_of_canonical_json(catalog, tiny_family, method) -> None:
    names = ingest_family(catalog, tiny_family)
    for frac in (0.0, 0.07, 0.3, 1.0):
        plan = catalog.plan(make_spec(method, names), budget=frac)
        assert plan.plan_hash == _reference_hash(plan) == plan_hash(plan)


def test_plan_hash_text_matches_for_every_read_kind(catalog, tiny_family) -> None:
    """Whole-tensor reads (-1), LoRA factor units (-2), gaps, runs and single blocks, in random plans."""
    names = ingest_family(catalog, tiny_family)
    plan = catalog.plan(make_spec("task_arithmetic", names), budget=1.0)
    rng = random.Random(5)
    for _ in range(30):
        access = {}
        for e in plan.experts:
            for t in plan.base_tensors:
                if rng.random() < 0.3:
                    continue
                if rng.random() < 0.15:
                    access[(e.position, t.idx)] = (Read(-1, 0, 1, "x"),)
                    continue
                blocks = sorted(rng.sample(range(t.n_blocks), rng.randint(0, t.n_blocks)))
                if rng.random() < 0.3:
                    blocks = [-2, *blocks]
                access[(e.position, t.idx)] = tuple(Read(b, 0, 1, "x") for b in blocks)
        plan = dataclasses.replace(plan, access=access)
        assert plan_hash(plan) == _reference_hash(plan)


def test_numpy_fetch_and_portable_fetch_give_the_same_plan(catalog, tiny_family, monkeypatch) -> None:
    names = ingest_family(catalog, tiny_family)
    for method, frac in (("task_arithmetic", 0.2), ("ties", 0.5), ("slerp", 0.4), ("linear", 1.0)):
        fast = catalog.plan(make_spec(method, names), budget=frac)
        with monkeypatch.context() as m:
            m.setattr(fetch, "NUMPY_FETCH_DIALECTS", ())
            slow = catalog.plan(make_spec(method, names), budget=frac)
        assert fast.plan_hash == slow.plan_hash and fast.access == slow.access
        assert fast.full_selection == slow.full_selection and fast.summary() == slow.summary()
        assert all(type(v) is int for reads in fast.access.values() for r in reads
                   for v in (r.block_idx, r.offset, r.nbytes))


def _independent_selection(catalog, plan: Plan) -> set[tuple[int, int, int]]:
    """The access set by the rule itself: candidates (non-zero delta, arithmetic dtype) ranked by score DESC
    NULLS LAST, base tensor_idx, block_idx, position; the prefix whose running cost fits the budget."""
    base_idx = {t.name: t.idx for t in plan.base_tensors}
    cands = []
    with catalog.db.connect() as conn:
        for e in plan.experts:
            rows = conn.execute(sa.text(
                "SELECT t.name, t.dtype, b.block_idx, b.nbytes, b.delta_l2 FROM mp_block b JOIN mp_tensor t "
                "ON t.checkpoint_id = b.checkpoint_id AND t.tensor_idx = b.tensor_idx WHERE b.checkpoint_id = :c"),
                {"c": e.checkpoint.id}).all()
            for name, dtype, bidx, nbytes, l2 in rows:
                if dtype in ARITHMETIC_DTYPES and name in base_idx and (l2 is None or l2 != 0):
                    score = None if l2 is None else abs(e.coef) * l2
                    cands.append((score, base_idx[name], bidx, e.position, nbytes))
    cands.sort(key=lambda c: (c[0] is None, -(c[0] or 0.0), c[1], c[2], c[3]))
    out, running = set(), 0
    for _score, tidx, bidx, pos, nbytes in cands:
        running += nbytes
        if running > plan.budget_bytes:
            break
        out.add((pos, tidx, bidx))
    return out


def test_selection_is_the_prefix_of_the_documented_ranking(catalog, tiny_family_f32) -> None:
    names = ingest_family(catalog, tiny_family_f32)
    for frac in (0.03, 0.25, 0.6):
        plan = catalog.plan(make_spec("task_arithmetic", names), budget=frac)
        got = {(pos, tidx, r.block_idx) for (pos, tidx), reads in plan.access.items() for r in reads}
        assert got == _independent_selection(catalog, plan)
        for reads in plan.access.values():
            assert [r.block_idx for r in reads] == sorted(r.block_idx for r in reads)
        assert plan.planned_bytes == sum(r.nbytes for reads in plan.access.values() for r in reads)
        assert math.isfinite(plan.bound_total)


def test_catalog_plan_opens_one_connection(catalog, tiny_family, monkeypatch) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("linear", names)
    catalog.plan(spec, budget=0.5)
    opened = []
    real = type(catalog.db).connect

    def counting(self, *a, **kw):
        opened.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(catalog.db), "connect", counting)
    catalog.plan(spec, budget=0.5)
    assert len(opened) == 1
