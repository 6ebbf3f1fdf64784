"""MergeKit 0.1.5 against mergepipe for the geometric methods (slerp, model_stock, nuslerp, multislerp, karcher):
every case merged by both on one small generated F32 family, at full budget, equal within 1e-6 relative per tensor.
slerp also takes "far", an expert of the same base with larger task vectors (delta_scale 0.3), so that some of
its tensors are in slerp's sine branch (the family's own experts are within the linear one, cos > 0.9995).

MergeKit runs once for all cases (one process of its venv merging each config in turn: its start-up costs ~5 s,
a merge of this family a fraction of a second)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.mergekit, pytest.mark.catalog]

EXPERTS = ("expert_00", "expert_01", "expert_02")

#: (case id, merge_method, models with parameters, global parameters)
CASES: list[tuple[str, str, list[tuple[str, dict]], dict]] = [
    ("slerp", "slerp", [("far", {})], {"t": 0.3}),
    ("slerp_near", "slerp", [(EXPERTS[1], {})], {"t": 0.7}),
    ("model_stock", "model_stock", [(e, {}) for e in EXPERTS], {}),
    ("model_stock_2", "model_stock", [(e, {}) for e in EXPERTS[:2]], {}),
    ("model_stock_fw", "model_stock", [(e, {}) for e in EXPERTS], {"filter_wise": True}),
    ("nuslerp", "nuslerp", [(EXPERTS[0], {"weight": 0.3}), (EXPERTS[2], {"weight": 0.7})], {}),
    ("nuslerp_rows", "nuslerp", [(EXPERTS[0], {"weight": 1.0}), (EXPERTS[1], {"weight": 2.0})],
     {"nuslerp_flatten": False}),
    ("nuslerp_cols", "nuslerp", [(EXPERTS[1], {"weight": 0.4}), (EXPERTS[2], {"weight": 0.6})],
     {"nuslerp_flatten": False, "nuslerp_row_wise": True}),
    ("multislerp", "multislerp", [(e, {"weight": w}) for e, w in zip(EXPERTS, (0.2, 0.3, 0.5))], {}),
    ("multislerp_raw", "multislerp", [(e, {"weight": w}) for e, w in zip(EXPERTS, (0.5, 1.0, 0.25))],
     {"normalize_weights": False}),
    ("multislerp_1", "multislerp", [(EXPERTS[1], {"weight": 1.0})], {}),
    ("karcher", "karcher", [(e, {}) for e in EXPERTS], {}),
    ("karcher_short", "karcher", [(e, {}) for e in EXPERTS[:2]], {"max_iter": 2, "tol": 1e-3}),
]

_RUNNER = r"""
import json, sys, yaml
import torch
torch.set_num_threads(1)  # karcher's float32 result moves ~1e-4 with the thread count (dot reduction order)
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
jobs = json.loads(open(sys.argv[1]).read())
for cfg_path, out in jobs:
    text = open(cfg_path).read()
    opts = MergeOptions(copy_tokenizer=False, random_seed=0)
    opts.apply_global_options()
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), out, options=opts, config_source=text)
"""


def _mergekit_config(fam, method: str, models: list[tuple[str, dict]], params: dict) -> dict:
    cfg: dict = {"merge_method": method, "base_model": str(fam.base),
                 "models": [{"model": str(fam.root / m), **({"parameters": p} if p else {})} for m, p in models],
                 "dtype": "float32"}
    if method == "slerp":  # MergeKit's slerp takes the base among its two models
        cfg["models"].insert(0, {"model": str(fam.base)})
    if params:
        cfg["parameters"] = params
    return cfg


def _spec(method: str, models: list[tuple[str, dict]], params: dict) -> dict:
    spec: dict = {"merge_method": method, "base_model": "base",
                  "models": [{"model": m, **({"parameters": p} if p else {})} for m, p in models],
                  "dtype": "float32"}
    if params:
        spec["parameters"] = params
    return spec


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory):
    """Both tools' outputs of every case: {case: (mergekit tensors, mergepipe tensors)}, plus the catalog."""
    import yaml
    from mergekit_peer import ensure_mergekit, load_dir

    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import make_family

    exe = ensure_mergekit()
    root = tmp_path_factory.mktemp("geo")
    fam = make_family(root / "fam", n_experts=3, preset="tiny", dtype="float32", seed=11)
    far = make_family(root / "far", n_experts=1, preset="tiny", dtype="float32", seed=11, delta_scale=0.3)
    shutil.copytree(far.experts[0], fam.root / "far")  # (the same base: base values do not depend on delta_scale)
    jobs = []
    for case, method, models, params in CASES:
        cfg = root / f"{case}.yml"
        cfg.write_text(yaml.safe_dump(_mergekit_config(fam, method, models, params), sort_keys=False))
        jobs.append([str(cfg), str(root / f"mk-{case}")])
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "runner.py").write_text(_RUNNER)
    proc = subprocess.run([str(exe.parent / "python"), str(root / "runner.py"), str(root / "jobs.json")],
                          capture_output=True, text=True, timeout=600,
                          env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    cat = Catalog.open(str(root / "cat.duckdb"))
    cat.ingest(fam.base, name="base", block_bytes=4096)
    cat.ingest_many([*fam.experts, fam.root / "far"], names=[*EXPERTS, "far"], base="base")
    out = {}
    for case, method, models, params in CASES:
        cat.merge(_spec(method, models, params), out=root / f"mp-{case}")
        out[case] = (load_dir(root / f"mk-{case}"), load_dir(root / f"mp-{case}"))
    out["fam"] = fam
    out["base"] = load_dir(fam.base)
    out["experts"] = {n: load_dir(p) for n, p in zip((*EXPERTS, "far"), (*fam.experts, fam.root / "far"))}
    return out, cat, root


def _rel(a, b) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / max(float(b64.norm()), 1e-30))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_equals_mergekit(merged, case: str) -> None:
    outputs, _cat, _root = merged
    mk, mp = outputs[case]
    assert set(mk) == set(mp)
    worst = max((_rel(mp[n], mk[n]), n) for n in mk)
    assert worst[0] <= 1e-6, f"{case}: {worst[1]} differs from MergeKit by {worst[0]:.3g} (relative)"
    # the method did something: the output is not the base
    base = outputs["base"]
    assert max(_rel(mp[n], base[n]) for n in mk) > 1e-4  # 100× the tolerance


def test_cases_differ_from_each_other(merged) -> None:
    """The cases are not all the same merge (a method ignoring its options would pass the test above only if
    MergeKit ignored them too; this checks that options change the output)."""
    outputs, _cat, _root = merged
    name = "model.layers.0.mlp.up_proj.weight"
    for a, b in (("model_stock", "model_stock_fw"), ("nuslerp_rows", "nuslerp_cols"),
                 ("multislerp", "multislerp_raw"), ("karcher", "karcher_short")):
        assert not np.array_equal(outputs[a][1][name].numpy(), outputs[b][1][name].numpy()), (a, b)


def test_replay_reproduces_options(merged, tmp_path: Path) -> None:
    """A merge with method options replays to the same bytes (the manifest records the options)."""
    _outputs, cat, root = merged
    for case in ("model_stock_fw", "nuslerp_cols", "karcher_short"):
        res = cat.replay(str(root / f"mp-{case}" / "manifest.json"), out=tmp_path / case, verify=True)
        assert res is not None
        a = json.loads((root / f"mp-{case}" / "manifest.json").read_text())["manifest"]["outputs"]["tensors"]
        b = json.loads((tmp_path / case / "manifest.json").read_text())["manifest"]["outputs"]["tensors"]
        assert a == b


@pytest.mark.parametrize(("method", "models", "params", "match"), [
    ("model_stock", [EXPERTS[0]], {}, "model_stock needs at least three models including the base"),
    ("nuslerp", list(EXPERTS), {}, "nuslerp merges exactly two models besides the base"),
    ("karcher", list(EXPERTS[:2]), {"max_iter": -1}, "karcher: parameter max_iter"),
    # (a list is a gradient in MergeKit's config language, so `[True, False]` is valid: a string is not)
    ("model_stock", list(EXPERTS[:2]), {"filter_wise": "yes"}, "parameters.filter_wise must be true or false"),
])
def test_bad_input_is_one_line_before_reading(merged, tmp_path: Path, capsys, method, models, params,
                                              match) -> None:
    """A constraint broken: exit code 1, one line naming the parameter, nothing written (no snapshot, no
    output)."""
    import yaml

    from mergepipe_db.cli import main

    _outputs, cat, root = merged
    spec = _spec(method, [(m, {"weight": 1.0} if method in ("nuslerp", "multislerp") else {}) for m in models],
                 params)
    path = tmp_path / "spec.yml"
    path.write_text(yaml.safe_dump(spec))
    before = cat.sql("SELECT count(*) FROM snapshots")[1]
    assert main(["merge", str(path), "--out", str(tmp_path / "out"), "--catalog", str(root / "cat.duckdb")]) == 1
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert cat.sql("SELECT count(*) FROM snapshots")[1] == before


@pytest.mark.parametrize("case", ["slerp", "model_stock", "model_stock_fw", "nuslerp", "nuslerp_rows",
                                  "nuslerp_cols", "multislerp", "karcher"])
def test_partial_budget_is_sound_deterministic_and_replayable(merged, tmp_path: Path, case: str) -> None:
    """Under a budget: realized bytes == planned ≤ budget, the same plan twice, and replay gives the same bytes.
    The row-local modes (model_stock filter_wise, nuslerp per row) read the same block rows of every expert,
    and some tensor only in part."""
    _outputs, cat, _root = merged
    _c, method, models, params = next(c for c in CASES if c[0] == case)
    spec = {**_spec(method, models, params), "budget": 0.4}
    p1, p2 = cat.plan(spec), cat.plan(spec)
    assert p1.plan_hash == p2.plan_hash
    assert 0 < p1.planned_bytes <= p1.budget_bytes < p1.full_bytes
    if case in ("model_stock_fw", "nuslerp_rows"):
        # block rows of every expert together: a row block read for one expert is read for every expert whose
        # Δ is nonzero there (the others have Δ = 0 there: nothing to read)
        outputs = _outputs
        partial = False
        for t in p1.base_tensors:
            read = set().union(*(p1.selected_blocks(e.position, t.idx) for e in p1.experts))
            for (m, _p), e in zip(models, p1.experts):
                d = outputs["experts"][m][t.name].float() - outputs["base"][t.name].float()
                for blk in range(t.n_blocks):
                    nonzero = bool(d.reshape(d.shape[0] if d.dim() else 1, -1)[
                        blk * t.rows_per_block:(blk + 1) * t.rows_per_block].abs().sum() > 0) if t.n_blocks > 1 \
                        else bool(d.abs().sum() > 0)
                    assert (blk in p1.selected_blocks(e.position, t.idx)) == (blk in read and nonzero), (t.name, m)
            partial |= 0 < len(read) < t.n_blocks
        assert partial
    res = cat.merge(spec, out=tmp_path / "a")
    doc = json.loads((tmp_path / "a" / "manifest.json").read_text())["manifest"]
    assert doc["realized"]["total"] == doc["planned_bytes"] == p1.planned_bytes
    cat.replay(str(tmp_path / "a" / "manifest.json"), out=tmp_path / "b", verify=True)
    again = json.loads((tmp_path / "b" / "manifest.json").read_text())["manifest"]
    assert again["outputs"] == doc["outputs"]
    assert res is not None


def _plain_slerp_coefficients(theta0: torch.Tensor, theta1: torch.Tensor, t: float) -> tuple[float, list[float]]:
    """slerp as a₀·θ₀ + c₁·Δ: (s0 + s1, [s1]) with s0, s1 MergeKit 0.1.5's weights, written plainly (numpy)."""
    a, b = theta0.reshape(-1).double().numpy(), theta1.reshape(-1).double().numpy()
    n0, n1 = float(np.sqrt(a @ a)), float(np.sqrt(b @ b))
    dot = float(a @ b) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
    if abs(dot) > 0.9995:
        return 1.0, [t]
    th = math.acos(dot)
    s0, s1 = math.sin(th - th * t) / math.sin(th), math.sin(th * t) / math.sin(th)
    return s0 + s1, [s1]


@pytest.mark.parametrize("case", ["slerp", "slerp_near", "model_stock", "nuslerp", "multislerp", "karcher_short"])
def test_budget_coefficients_come_from_the_catalog(merged, tmp_path: Path, case: str) -> None:
    """Under a budget the per-tensor methods are planned by blocks with coefficients from the catalog's
    statistics: the plan records them for every tensor some expert reads in part; the output there is
    a₀·θ₀ + Σ c_k·Δ_k with Δ_k zero on the rows not read (computed here from the files and the access set); the
    experts were ingested together, so the cross products are exact and the coefficients equal those of the
    exact Gram matrix (computed here from the files); replay reproduces the bytes from the manifest's
    coefficients."""
    from mergekit_peer import load_dir

    from mergepipe_db.operators import ExpertParams, make_operator

    outputs, cat, _root = merged
    _c, method, models, params = next(c for c in CASES if c[0] == case)
    spec = {**_spec(method, models, params), "budget": 0.5}
    plan = cat.plan(spec)
    partial = {t.name for t in plan.base_tensors if any(not plan.full_selection.get((e.position, t.idx), True)
                                                        for e in plan.experts)}
    assert partial and set(plan.coefficients) == partial
    assert any(0 < len(plan.selected_blocks(e.position, t.idx)) < t.n_blocks
               for t in plan.base_tensors for e in plan.experts)
    cat.merge(spec, out=tmp_path / "a")
    got = load_dir(tmp_path / "a")
    base = outputs["base"]
    thetas = [outputs["experts"][m] for m, _p in models]
    op = make_operator(method, [ExpertParams(str(k), weight=float(p.get("weight", 1.0))) for k, (_m, p) in
                                enumerate(models)], t=params.get("t"), options={k: v for k, v in params.items()
                                                                                 if k != "t"})
    for t in plan.base_tensors:
        if t.name not in partial:
            continue
        a0, c = plan.coefficients[t.name]
        b = base[t.name].float()
        want = b * a0
        deltas = []
        for e, th in zip(plan.experts, thetas):
            d = th[t.name].float() - b
            keep = torch.zeros(d.shape[0], dtype=torch.bool)
            for blk in plan.selected_blocks(e.position, t.idx):
                keep[blk * t.rows_per_block:(blk + 1) * t.rows_per_block] = True
            d = torch.where(keep.view(-1, *([1] * (d.dim() - 1))), d, torch.zeros_like(d))
            deltas.append(d)
            want = want + d * float(c[e.position])
        assert _rel(got[t.name], want) <= 1e-6, t.name
    small = sine = 0
    tiny = cat.plan({**spec, "budget": 0.05})
    for t in tiny.base_tensors:
        b = base[t.name].float()
        if t.name in tiny.coefficients:
            a0, c = tiny.coefficients[t.name]
            full = [b.reshape(1, -1).double()] + [(th[t.name].float() - b).reshape(1, -1).double() for th in thetas]
            g = np.array([[float((x * y).sum()) for y in full] for x in full])
            if method == "slerp":  # the plain formula on the tensors: the statistics' products are exact
                ea0, ec = _plain_slerp_coefficients(b, thetas[0][t.name].float(), params["t"])
                assert a0 == pytest.approx(ea0, rel=1e-6) and c == pytest.approx(ec, rel=1e-6), t.name
                sine += a0 != pytest.approx(1.0, abs=1e-9)
            else:
                ea0, ec = op.coefficients_from_gram(g)
                assert a0 == pytest.approx(ea0, rel=1e-7) and c == pytest.approx(ec, rel=1e-4, abs=1e-8), t.name
            small += 1
    assert small >= 10
    assert sine >= (3 if case == "slerp" else 0)  # "far": some tensor in the sine branch
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())["manifest"]
    assert set(man["coefficients"]) == partial
    cat.replay(str(tmp_path / "a" / "manifest.json"), out=tmp_path / "b", verify=True)
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["manifest"]["outputs"] == man["outputs"]


def test_experts_ingested_one_at_a_time_plan_from_sketches(merged, tmp_path: Path) -> None:
    """Experts catalogued one at a time have no exact cross products: the planner estimates them from the count
    sketches — the same coefficients as the exact ones for tensors of at most 1,024 elements, other ones for
    some larger tensor — and the merge is still sound and replayable."""
    from mergepipe_db import Catalog

    outputs, cat, _root = merged
    fam = outputs["fam"]
    sep = Catalog.open(str(tmp_path / "sep.duckdb"))
    sep.ingest(fam.base, name="base", block_bytes=4096)
    for name, path in zip(EXPERTS, fam.experts):
        sep.ingest(path, name=name, base="base")
    spec = {**_spec("model_stock", [(e, {}) for e in EXPERTS], {}), "budget": 0.05}
    exact, est = cat.plan(spec), sep.plan(spec)
    assert exact.coefficients.keys() == est.coefficients.keys() and exact.coefficients
    sizes = {t.name: int(np.prod(t.shape)) for t in exact.base_tensors}
    same = {n: est.coefficients[n][1] == pytest.approx(exact.coefficients[n][1], rel=1e-4, abs=1e-8)
            for n in exact.coefficients}
    assert all(same[n] for n in same if sizes[n] <= 1024)
    assert not all(same[n] for n in same if sizes[n] > 1024)
    sep.merge(spec, out=tmp_path / "a")
    doc = json.loads((tmp_path / "a" / "manifest.json").read_text())["manifest"]
    assert doc["realized"]["total"] == doc["planned_bytes"] <= doc["budget_bytes"]
    sep.replay(str(tmp_path / "a" / "manifest.json"), out=tmp_path / "b", verify=True)


SLERP_CONFIG = """
slices:
  - sources:
      - model: base
        layer_range: [0, 2]
      - model: far
        layer_range: [0, 2]
merge_method: slerp
base_model: base
parameters:
  t:
    - filter: self_attn
      value: [0.1, 0.9]
    - filter: mlp
      value: [0.8, 0.3]
    - value: 0.4
dtype: float32
"""


def test_slerp_config_with_t_gradients_plans_by_blocks(merged, tmp_path: Path) -> None:
    """slerp through a MergeKit config (slices, t by filter and gradient): under a budget each tensor's
    (a₀, c₁) come from the catalog's statistics with that tensor's own t (equal to the plain formula on the
    files); a tensor read in part is θ₀·a₀ + Δ̃·c₁, a tensor read whole the full-budget merge's; realized ==
    planned ≤ budget, and replay gives the same bytes."""
    from mergekit_peer import load_dir

    outputs, cat, _root = merged
    spec = tmp_path / "slerp.yml"
    spec.write_text(SLERP_CONFIG)
    plan = cat.plan(str(spec), budget=0.4)
    assert plan.plan_hash == cat.plan(str(spec), budget=0.4).plan_hash
    assert 0 < plan.planned_bytes <= plan.budget_bytes < plan.full_bytes
    partial = {t.name for t in plan.base_tensors if not plan.full_selection.get((0, t.idx), True)}
    assert partial and set(plan.coefficients) == partial
    assert any(0 < len(plan.selected_blocks(0, t.idx)) < t.n_blocks for t in plan.base_tensors)
    base, far = outputs["base"], outputs["experts"]["far"]
    ts, sine = set(), 0
    tiny = cat.plan(str(spec), budget=0.05)  # most tensors read in part (coefficients recorded)
    for t in tiny.base_tensors:
        if t.name in tiny.coefficients:
            tt = float(tiny.tensor_params[t.idx][1]["t"])
            ts.add(tt)
            a0, c = tiny.coefficients[t.name]
            ea0, ec = _plain_slerp_coefficients(base[t.name].float(), far[t.name].float(), tt)
            assert a0 == pytest.approx(ea0, rel=1e-6) and c == pytest.approx(ec, rel=1e-6), t.name
            sine += a0 != pytest.approx(1.0, abs=1e-9)
    assert len(ts) >= 4 and sine >= 3  # the tensors' own t (gradients, filters); some in the sine branch
    cat.merge(str(spec), out=tmp_path / "a", budget=0.4)
    cat.merge(str(spec), out=tmp_path / "full", budget=1.0)
    got, full = load_dir(tmp_path / "a"), load_dir(tmp_path / "full")
    for t in plan.base_tensors:
        if t.name not in partial:
            assert torch.equal(got[t.name], full[t.name]), t.name
            continue
        a0, (c1,) = plan.coefficients[t.name]
        b = base[t.name].float()
        keep = torch.zeros(b.shape[0] if b.dim() else 1, dtype=torch.bool)
        for blk in plan.selected_blocks(0, t.idx):
            keep[blk * t.rows_per_block:(blk + 1) * t.rows_per_block] = True
        d = torch.where(keep.view(-1, *([1] * (b.dim() - 1))), far[t.name].float() - b, torch.zeros_like(b))
        assert _rel(got[t.name], b * a0 + d * c1) <= 1e-6, t.name
    doc = json.loads((tmp_path / "a" / "manifest.json").read_text())["manifest"]
    assert doc["realized"]["total"] == doc["planned_bytes"] == plan.planned_bytes
    assert set(doc["coefficients"]) == partial
    cat.replay(str(tmp_path / "a" / "manifest.json"), out=tmp_path / "b", verify=True)
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["manifest"]["outputs"] == doc["outputs"]
