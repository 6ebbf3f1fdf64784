"""Every merge method (passthrough: test_passthrough_reuse.py) on a BF16 family — the dtype of real checkpoints;
the differential suites use F32 —, at a partial budget and at full budget: the merge runs, and the expert bytes
read, counted at the byte store outside the executor, equal the plan's and the manifest's per expert and stay
within the budget. A partial-budget geometric merge on BF16 once failed in numba (the BF16 base-only table and
the planned coefficients shared an attribute)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ingest_family
from store_reads import ReadLog, catalogued_files, merge_counted

pytestmark = pytest.mark.catalog

#: method -> (models' parameters, in order: one per expert merged; global parameters)
SPECS: dict[str, tuple[list[dict], dict]] = {
    "linear": ([{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}], {}),
    "task_arithmetic": ([{"weight": 0.5}, {"weight": 0.7}, {"weight": -0.3}], {}),
    "ties": ([{"weight": 1.0, "density": 0.5}, {"weight": 0.5, "density": 0.3}, {"weight": 0.7}], {}),
    "dare_linear": ([{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5}, {"weight": 0.4}], {}),
    "dare_ties": ([{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5}, {"weight": 0.4}], {}),
    "breadcrumbs": ([{"weight": 0.5, "density": 0.8, "gamma": 0.05}, {"weight": 0.5}, {"weight": 0.4}], {}),
    "breadcrumbs_ties": ([{"weight": 0.6, "density": 0.7, "gamma": 0.05}, {"weight": 0.5}, {"weight": 0.4}], {}),
    "della": ([{"weight": 1.0, "density": 0.6, "epsilon": 0.2}, {"weight": 0.8, "density": 0.5},
               {"weight": 0.6, "density": 0.4, "epsilon": 0.1}], {}),
    "della_linear": ([{"weight": 0.6, "density": 0.5, "epsilon": 0.3}, {"weight": 0.5, "density": 0.7},
                      {"weight": 0.4, "density": 0.4}], {}),
    "sce": ([{}, {}, {}], {"select_topk": 0.5}),
    "model_stock": ([{}, {}, {}], {}),
    # two experts: some tensors of the BF16 family are unchanged by every expert, where multislerp of three or
    # more refuses (the weighted mean of zero unit vectors is zero: MergeKit's ValueError) and two fall back to lerp
    "multislerp": ([{"weight": 0.2}, {"weight": 0.8}], {}),
    "karcher": ([{}, {}, {}], {}),
    "ram": ([{}, {}, {}], {"epsilon": 1e-4}),
    "ramplus_tl": ([{}, {}, {}], {"epsilon": 1e-4, "r": 0.3, "alpha": 0.5}),
    "nuslerp": ([{"weight": 0.3}, {"weight": 0.7}], {}),
    "slerp": ([{}], {"t": 0.3}),
    "nearswap": ([{}], {"t": 0.001}),
    "arcee_fusion": ([{}], {}),
}


def test_every_method_is_covered() -> None:
    """passthrough copies source tensors outside the budget (its reads: test_passthrough_reuse.py)."""
    from mergepipe_db.core.spec import METHOD_PARAMS

    assert set(SPECS) == set(METHOD_PARAMS) - {"passthrough"}


@pytest.fixture
def fam(catalog, tiny_family):
    names = ingest_family(catalog, tiny_family)
    return catalog, names


@pytest.mark.parametrize("method", sorted(SPECS))
def test_method_on_bf16_within_budget(fam, tmp_path: Path, byte_reads: ReadLog, method: str) -> None:
    cat, names = fam
    models, params = SPECS[method]
    spec = {"merge_method": method, "base_model": "base", "seed": 7, "parameters": dict(params),
            "models": [{"model": n, "parameters": dict(p)} for n, p in zip(names, models)]}
    files = catalogued_files(cat)
    outs = {}
    for budget in ("0.25", "1.0"):
        res, plan, manifest = merge_counted(cat, byte_reads, files, spec, tmp_path / f"out-{budget}", budget)
        assert res.realized_bytes == plan.planned_bytes <= plan.budget_bytes
        outs[budget] = {p.name: p.read_bytes() for p in sorted((tmp_path / f"out-{budget}").glob("*.safetensors"))}
        assert outs[budget], f"{method} @{budget}: no output shard"
