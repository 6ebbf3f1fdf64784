"""Issue 35, part A, through the catalog: breadcrumbs_ties, della, della_linear, sce, nearswap, ram, ramplus_tl and
arcee_fusion under a budget (sound, deterministic, replayable, and equal to their formula on the rows the plan
read — written plainly below, sharing no code with the operators), the DARE/DELLA `rescale` modes (and the
manifests made before the option replaying to their bytes), and each method's bad input (one named error before
anything is read, nothing written). Agreement with MergeKit at full budget: test_mergekit_methods.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BLOCK
from reference_merge import assert_bytes_equal, load_model, load_output, reference_merge, row_blocks

from mergepipe_db.errors import MethodParameterError, SpecError

pytestmark = pytest.mark.catalog

CASES: dict[str, tuple[list[dict], dict]] = {
    "breadcrumbs_ties": ([{"weight": 0.6, "density": 0.7, "gamma": 0.05}, {"weight": 0.5, "density": 0.6},
                          {"weight": 0.4, "density": 0.8}], {}),
    "della": ([{"weight": 1.0, "density": 0.6, "epsilon": 0.2}, {"weight": 0.8, "density": 0.5},
               {"weight": 0.6, "density": 0.4, "epsilon": 0.1}], {}),
    "della_linear": ([{"weight": 0.6, "density": 0.5, "epsilon": 0.3}, {"weight": 0.5, "density": 0.7},
                      {"weight": 0.4, "density": 0.4}], {"rescale": False}),
    "sce": ([{}, {}, {}], {"select_topk": 0.5}),
    "nearswap": ([{}], {"t": 0.001}),
    "ram": ([{}, {}, {}], {"epsilon": 1e-4}),
    "ramplus_tl": ([{}, {}, {}], {"epsilon": 1e-4, "r": 0.3, "alpha": 0.5}),
    "arcee_fusion": ([{}], {}),
}
#: formulas written plainly below (the others are checked against MergeKit at full budget)
PLAIN = ("sce", "nearswap", "ram", "ramplus_tl", "arcee_fusion")


def _spec(method: str, names: list[str], *, seed: int = 11, params: dict | None = None) -> dict:
    models, gparams = CASES[method]
    return {"merge_method": method, "base_model": "base", "seed": seed,
            "models": [{"model": n, "parameters": dict(p)} for n, p in zip(names, models)],
            "parameters": dict(gparams if params is None else params)}


@pytest.fixture
def fam(catalog, tiny_family_f32):
    catalog.ingest(tiny_family_f32.base, name="base", block_bytes=BLOCK)
    names = []
    for i, p in enumerate(tiny_family_f32.experts):
        catalog.ingest(p, name=f"e{i}", base="base")
        names.append(f"e{i}")
    return tiny_family_f32, names


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _read_rows(manifest: dict, base: dict[str, torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """Per (expert position, tensor): a bool mask of the elements whose rows the plan read."""
    masks: dict[tuple[int, str], torch.Tensor] = {}
    for pos, name, ranges in manifest["access"]:
        shape = tuple(base[name].shape)
        blocks = row_blocks(shape, base[name].element_size(), BLOCK)
        m = torch.zeros(shape, dtype=torch.bool)
        for lo, hi in ranges:
            for b in range(lo, hi):
                s, e = blocks[b]
                if len(shape) == 0:
                    m = torch.ones((), dtype=torch.bool)
                else:
                    m[s:e] = True
        masks[(pos, name)] = m
    return masks


# -- the formulas, plainly (docs/SEMANTICS.md) ----------------------------------------------------------------


def plain_nearswap(b, th, t):
    w = (t / (b - th).abs().clamp(min=1e-6)).clamp(0, 1)
    return w * th + (1 - w) * b


def plain_ram(b, tvs, eps, r=None, alpha=None):
    nz = [tv.abs() > eps for tv in tvs]
    c = sum(m.to(torch.int64) for m in nz)
    unique, overlap = c == 1, c > 1
    out = torch.zeros_like(b)
    for tv, m in zip(tvs, nz):
        lam = 1.0
        if r is not None:
            rho = int((m & overlap).sum()) / max(float(int((m & unique).sum())), eps)
            lam = 1.0 + r * min(max(rho, 0.0), alpha)
        z = torch.where(m, tv, 0.0)
        out = out + torch.where(unique, z * lam, 0.0) + torch.where(overlap, z / c.clamp(min=1).float(), 0.0)
    return b + out


#: elements whose sce variance lies within this relative distance of the top-k cut: the operator (torch's float32
#: var) and the plain float64 variance may order them differently, so they are not compared
AMBIGUOUS: dict[str, torch.Tensor] = {}


def plain_sce(b, tvs, topk, name=""):
    tv = torch.stack(tvs)
    if topk < 1:
        var = ((tv.double() - tv.double().mean(0)) ** 2).mean(0)
        k = int(int((var != 0).sum()) * topk)
        keep = torch.zeros(var.numel(), dtype=torch.bool)
        if k:
            order = var.flatten().argsort(descending=True)
            keep[order[:k]] = True
            cut = float(var.flatten()[order[k - 1]])
            AMBIGUOUS[name] = ((var - cut).abs() <= 1e-5 * cut)
        tv = tv * keep.reshape(var.shape)
    majority = torch.where(tv.sum(0) >= 0, 1.0, -1.0)
    agree = tv.sign() == majority
    w = torch.stack([(x.double() ** 2).mean() for x in tv])
    w = torch.full_like(w, 1 / len(tvs)) if abs(float(w.sum())) < 1e-6 else w / w.sum()
    num = sum(torch.where(agree[k], tv[k] * float(w[k]), 0.0) for k in range(len(tvs)))
    den = sum(torch.where(agree[k], float(w[k]), 0.0) for k in range(len(tvs)))
    return b + num / den.clamp(min=1e-6)


def plain_arcee_fusion(b, th):
    p = torch.softmax(th, dim=-1) + 1e-8
    q = torch.softmax(b, dim=-1) + 1e-8
    imp = (th - b).abs() * (p * (p / q).log()).sum(-1, keepdim=True)
    s = imp.flatten().sort().values
    q1, med, q3 = (s[int(f * (s.numel() - 1))] for f in (0.25, 0.5, 0.75))
    return torch.where(imp >= med + 1.5 * (q3 - q1), th, b)


def plain_merge(method: str, base: dict, experts: list[dict], read, params: dict) -> dict:
    out = {}
    for name, b0 in base.items():
        b = b0.float()
        ths = [torch.where(read.get((k, name), torch.zeros(b.shape, dtype=torch.bool)), e[name].float(), b)
               for k, e in enumerate(experts)]
        tvs = [th - b for th in ths]
        if method == "nearswap":
            out[name] = plain_nearswap(b, ths[0], params["t"])
        elif method == "ram":
            out[name] = plain_ram(b, tvs, params["epsilon"])
        elif method == "ramplus_tl":
            out[name] = plain_ram(b, tvs, params["epsilon"], params["r"], params["alpha"])
        elif method == "sce":
            out[name] = plain_sce(b, tvs, params["select_topk"], name)
        else:
            out[name] = plain_arcee_fusion(b, ths[0])
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: tuple) -> None:
    """Within 1e-6 relative; sce: apart from the few elements at its variance cut (`AMBIGUOUS`)."""
    amb = AMBIGUOUS.pop(what[-1], None) if what[0] == "sce" else None
    if amb is not None:
        assert int(amb.sum()) <= max(2, amb.numel() // 500), (what, int(amb.sum()))
        got, want = got[~amb], want[~amb]
    diff = float((got - want).norm()) / max(float(want.norm()), 1e-30)
    assert diff <= 1e-6, (what, diff)


@pytest.mark.parametrize("method", list(CASES))
def test_budgeted_merge_is_sound_deterministic_and_replays(catalog, fam, tmp_path, method) -> None:
    family, names = fam
    n = len(CASES[method][0])
    spec = _spec(method, names[:n])
    first = catalog.merge(spec, out=tmp_path / "first", budget=0.3)
    assert first.planned_bytes <= first.budget_bytes and first.realized_bytes == first.planned_bytes
    assert 0 < first.planned_bytes < first.full_bytes
    again = catalog.merge(spec, out=tmp_path / "again", budget=0.3)
    assert again.plan_hash == first.plan_hash
    assert _shards(tmp_path / "again") == _shards(tmp_path / "first")
    replayed = catalog.replay(first.snapshot_id, out=tmp_path / "replay", verify=True)
    assert replayed.manifest_hash == first.manifest_hash
    assert _shards(tmp_path / "replay") == _shards(tmp_path / "first")
    if method in PLAIN:  # the formula on the rows the plan read (θ_k = θ₀ elsewhere)
        manifest = json.loads((tmp_path / "first" / "manifest.json").read_text())["manifest"]
        base = load_model(Path(family.base))
        experts = [load_model(Path(p)) for p in family.experts[:n]]
        read = _read_rows(manifest, base)
        want = plain_merge(method, base, experts, read, {**{"epsilon": 1e-5}, **CASES[method][1]})
        got = load_output(tmp_path / "first")
        for name in base:
            _close(got[name].float(), want[name], (method, name))
        full = catalog.merge(spec, out=tmp_path / "full")
        want_full = plain_merge(method, base, experts, {(k, nm): torch.ones(t.shape, dtype=torch.bool)
                                                         for k in range(n) for nm, t in base.items()},
                                {**{"epsilon": 1e-5}, **CASES[method][1]})
        got_full = load_output(tmp_path / "full")
        assert full.realized_bytes == full.planned_bytes
        for name in base:
            _close(got_full[name].float(), want_full[name], (method, "full", name))


def test_plan_shapes_follow_the_methods_needs(catalog, fam, tmp_path) -> None:
    """Joint methods read block rows of every expert together; arcee_fusion reads whole tensors."""
    family, names = fam
    base = load_model(Path(family.base))
    experts = [load_model(Path(p)) for p in family.experts]
    for method in ("sce", "ram", "ramplus_tl", "della", "breadcrumbs_ties"):
        res = catalog.merge(_spec(method, names), out=tmp_path / method, budget=0.3)
        manifest = json.loads((tmp_path / method / "manifest.json").read_text())["manifest"]
        rows: dict[str, list[set[int]]] = {}
        for pos, name, ranges in manifest["access"]:
            rows.setdefault(name, [set(), set(), set()])[pos].update(b for lo, hi in ranges for b in range(lo, hi))
        for name, per in rows.items():
            blocks = row_blocks(tuple(base[name].shape), base[name].element_size(), BLOCK)
            for b in set().union(*per):
                s, e = blocks[b]
                for k in range(3):  # a block row read is read for every expert whose Δ is nonzero there
                    zero = torch.equal(experts[k][name][s:e], base[name][s:e]) if base[name].dim() else True
                    assert b in per[k] or zero, (method, name, b, k)
        assert res.planned_bytes > 0
    catalog.merge(_spec("arcee_fusion", names[:1]), out=tmp_path / "af", budget=0.3)
    manifest = json.loads((tmp_path / "af" / "manifest.json").read_text())["manifest"]
    for _pos, name, ranges in manifest["access"]:
        n_blocks = len(row_blocks(tuple(base[name].shape), base[name].element_size(), BLOCK))
        assert ranges == [[0, n_blocks]], name


@pytest.mark.parametrize("rescale,mode", [(None, "l1"), (True, "l1"), (False, "none"), ("classic", "classic")])
def test_dare_rescale_modes_equal_the_reference_and_are_recorded(catalog, fam, tmp_path, rescale, mode) -> None:
    family, names = fam
    models = [{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5}, {"weight": 0.4, "density": 0.9}]
    params = {} if rescale is None else {"rescale": rescale}
    for method in ("dare_linear", "dare_ties"):
        spec = {"merge_method": method, "base_model": "base", "seed": 5, "parameters": dict(params),
                "models": [{"model": n, "parameters": p} for n, p in zip(names, models)]}
        out = tmp_path / f"{method}-{mode}"
        catalog.merge(spec, out=out)
        manifest = json.loads((out / "manifest.json").read_text())["manifest"]
        recorded = manifest["spec"]["parameters"].get("rescale")
        assert recorded == (None if mode == "classic" else mode)
        want = reference_merge(method, Path(family.base), [Path(p) for p in family.experts], models, seed=5,
                               expert_keys=[catalog.checkpoint_id(n) for n in names], block_bytes=BLOCK,
                               rescale=mode)
        assert_bytes_equal(load_output(out), want)
        again = catalog.replay(out / "manifest.json", out=tmp_path / f"{method}-{mode}-replay", verify=True)
        assert _shards(tmp_path / f"{method}-{mode}-replay") == _shards(out)
        assert again.plan_hash == manifest["plan_hash"]


def test_manifest_without_rescale_replays_classic_bytes(catalog, fam, tmp_path) -> None:
    """A snapshot made before `rescale` was honoured has no `rescale` in its manifest: replay gives the classic
    1/density bytes, whatever the new default. Here such a manifest is made by taking `rescale` out of a
    default (l1) merge's manifest: replay then rebuilds the classic plan, whose hash differs from the l1 one's."""
    family, names = fam
    models = [{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5}]
    spec = {"merge_method": "dare_linear", "base_model": "base", "seed": 9,
            "models": [{"model": n, "parameters": p} for n, p in zip(names, models)],
            "parameters": {"rescale": "classic"}}
    classic = catalog.merge(spec, out=tmp_path / "classic", budget=0.5)
    doc = json.loads((tmp_path / "classic" / "manifest.json").read_text())
    assert "rescale" not in doc["manifest"]["spec"]["parameters"]  # exactly the format of the old manifests
    replayed = catalog.replay(tmp_path / "classic" / "manifest.json", out=tmp_path / "replay", verify=True)
    assert replayed.plan_hash == classic.plan_hash
    assert _shards(tmp_path / "replay") == _shards(tmp_path / "classic")
    # the same merge with the new default differs (the plan records l1)
    l1 = catalog.merge({**spec, "parameters": {}}, out=tmp_path / "l1", budget=0.5)
    assert l1.plan_hash != classic.plan_hash
    assert _shards(tmp_path / "l1") != _shards(tmp_path / "classic")


BAD: list[tuple[str, dict, dict | None, str]] = [
    ("nearswap", {"t": 0.1}, None, "exactly two models"),
    ("nearswap", {}, "one", "needs parameters.t"),
    ("arcee_fusion", {}, None, "exactly two models"),
    ("della", {}, {"weight": 1.0, "density": 0.9, "epsilon": 0.15}, "epsilon"),
    ("della_linear", {"epsilon": 0.5}, {"weight": 1.0, "density": 0.4}, "epsilon"),
    ("dare_linear", {"rescale": "l2"}, {"weight": 1.0, "density": 0.5}, "rescale"),
    ("ties", {"rescale": "l2"}, {"weight": 1.0, "density": 0.5}, "rescale"),
    ("sce", {"select_topk": "half"}, {}, "select_topk"),
    ("ramplus_tl", {"alpha": float("inf")}, {}, "alpha"),
    ("ramplus_tl", {"epsilon": 0.0}, {}, "epsilon must be > 0"),
]
# A parameter of another method (`r` under ram, `select_topk` under linear) is ignored, as MergeKit does
# (tests/core/test_mergekit_config.py); values of the wrong type are SpecErrors naming the key path.


@pytest.mark.parametrize("method,gparams,model,needle", BAD)
def test_bad_input_is_one_named_error_before_anything_is_read(catalog, fam, tmp_path, method, gparams, model,
                                                              needle) -> None:
    _family, names = fam
    models = ([{"model": names[0], "parameters": {}}] if model == "one" else
              [{"model": n, "parameters": dict(model)} for n in names[:2]] if model is not None else
              [{"model": n, "parameters": {}} for n in names[:2]])
    spec = {"merge_method": method, "base_model": "base", "models": models, "parameters": gparams}
    before = catalog.sql("SELECT count(*) FROM snapshots")[1]
    with pytest.raises(SpecError, match=needle) as info:  # MethodParameterError or a type error of the config
        catalog.merge(spec, out=tmp_path / "out")
    assert "\n" not in str(info.value)
    # a method's constraint is MethodParameterError; a value of the wrong type the config's own SpecError
    assert isinstance(info.value, MethodParameterError) or " must be " in str(info.value)
    assert not (tmp_path / "out").exists()
    assert catalog.sql("SELECT count(*) FROM snapshots")[1] == before


def test_cli_bad_input_exit_1_one_line(catalog_url, fam, tmp_path) -> None:
    import yaml

    _family, names = fam
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump({"merge_method": "della", "base_model": "base",
                                    "models": [{"model": names[0], "parameters": {"weight": 1, "density": 0.1}}]}))
    proc = subprocess.run([sys.executable, "-m", "mergepipe_db.cli", "merge", "--catalog", catalog_url, str(spec),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "epsilon" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_della_keep_probabilities_follow_row_ranks() -> None:
    """DELLA's keep probability of an element, by its |Δ| rank in its row, from the operator's own draws: over
    many blocks the kept fraction of the smallest and the largest rank approaches d − ε and d + ε."""
    from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

    rows, cols, d, eps = 4096, 8, 0.5, 0.3
    rng = np.random.default_rng(0)
    base = np.zeros((rows, cols), np.float32)
    delta = rng.normal(size=(rows, cols)).astype(np.float32)
    ctx = TensorContext("w", (rows, cols), 64, rows // 64, 0)
    p = ExpertParams("key", weight=1.0, density=d, epsilon=eps)
    op = make_operator("della_linear", [p], options={"rescale": "none"})
    op.begin(base, ctx)
    op.add(ExpertInput.from_delta(0, p, range(ctx.n_blocks), True, delta=delta))
    out = op.finish()
    kept = out != 0
    order = np.argsort(np.abs(delta), axis=1, kind="stable")
    low = kept[np.arange(rows), order[:, 0]].mean()
    high = kept[np.arange(rows), order[:, -1]].mean()
    se = math.sqrt(0.25 / rows)
    assert abs(low - (d - eps)) < 5 * se and abs(high - (d + eps)) < 5 * se, (low, high)
    assert np.array_equal(out[kept], delta[kept])  # rescale: none keeps the values


def test_quality_benchmark_accepts_the_new_methods() -> None:
    """benchmarks/quality.py forms a valid spec and a validation grid for each of part A's methods (the
    benchmark itself is not run here)."""
    from benchmarks import quality as q
    from mergepipe_db.core.spec import load_spec

    cfg = q.Config()
    for method in CASES:
        grid = q.method_grid(cfg, method)
        assert grid
        for lam, d in grid:
            spec = load_spec(q.make_spec(method, ("a", "b", "c"), lam, d, 0))
            assert spec.method == method
            assert len(spec.models) == (1 if method in ("nearswap", "arcee_fusion") else 3)
    with pytest.raises(ValueError, match="does not know"):
        q.method_grid(cfg, "passthrough_x")


def _selected_rows(manifest: dict, base: dict[str, torch.Tensor], n: int) -> list[dict]:
    """The rows each expert's plan read, as `reference_merge`'s ``selected_rows``."""
    rows: list[dict] = [{} for _ in range(n)]
    for pos, name, ranges in manifest["access"]:
        blocks = row_blocks(tuple(base[name].shape), base[name].element_size(), BLOCK)
        rows[pos][name] = [blocks[b] for lo, hi in ranges for b in range(lo, hi)]
    return rows


@pytest.mark.parametrize("rescale", [True, False])
def test_dare_rescale_under_a_budget_is_the_formula_on_the_rows_read(catalog, fam, tmp_path, rescale) -> None:
    """At budget 0.4 the L1 ratio is measured over the rows read (omitted rows: Δ = 0 in both sums)."""
    family, names = fam
    models = [{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5}, {"weight": 0.4, "density": 0.9}]
    for method in ("dare_linear", "dare_ties"):
        spec = {"merge_method": method, "base_model": "base", "seed": 6, "parameters": {"rescale": rescale},
                "models": [{"model": n, "parameters": p} for n, p in zip(names, models)]}
        out = tmp_path / method
        res = catalog.merge(spec, out=out, budget=0.4)
        assert res.planned_bytes <= res.budget_bytes
        manifest = json.loads((out / "manifest.json").read_text())["manifest"]
        base = load_model(Path(family.base))
        want = reference_merge(method, Path(family.base), [Path(p) for p in family.experts], models, seed=6,
                               expert_keys=[catalog.checkpoint_id(n) for n in names], block_bytes=BLOCK,
                               rescale="l1" if rescale else "none",
                               selected_rows=_selected_rows(manifest, base, len(models)))
        assert_bytes_equal(load_output(out), want)


def test_della_classic_rescale_divides_by_the_keep_probability() -> None:
    """rescale: classic for DELLA keeps Δ / p, p = (d − ε) + 2ε·(rank / (n − 1)) with the rank of |Δ| in its row
    (written here with argsort of argsort, as MergeKit ranks)."""
    from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

    rows, cols, d, eps = 64, 16, 0.5, 0.2
    rng = np.random.default_rng(1)
    base = rng.normal(size=(rows, cols)).astype(np.float32)
    delta = (rng.normal(size=(rows, cols)) * 0.01).astype(np.float32)
    ctx = TensorContext("w", (rows, cols), 8, rows // 8, 3)
    p = ExpertParams("key", weight=1.0, density=d, epsilon=eps)
    op = make_operator("della_linear", [p], options={"rescale": "classic"})
    op.begin(base, ctx)
    op.add(ExpertInput.from_theta(0, p, range(ctx.n_blocks), True, theta=base + delta))
    out = op.finish()
    d_k = (base + delta) - base
    ranks = torch.from_numpy(np.abs(d_k)).argsort(dim=1).argsort(dim=1).float()
    prob = (d - eps) + ranks / (cols - 1) * 2 * eps
    kept = out != base
    assert 0.3 < kept.mean() < 0.7
    want = base + d_k / prob.numpy()
    np.testing.assert_allclose(out[kept], want[kept], rtol=1e-6, atol=0)


def test_arcee_fusion_above_its_sampling_size_is_seeded() -> None:
    """Above 1e6 elements the quantiles come from a keyed sample: the same seed gives the same bytes, and the
    result is the formula with the threshold of that sample (between the exact quantile's neighbours)."""
    from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

    rows, cols = 1100, 1000
    rng = np.random.default_rng(2)
    base = rng.normal(size=(rows, cols)).astype(np.float32)
    theta = base + (rng.normal(size=(rows, cols)) * 0.05).astype(np.float32)

    def run(seed: int) -> np.ndarray:
        ctx = TensorContext("big", (rows, cols), rows, 1, seed)
        p = ExpertParams("key")
        op = make_operator("arcee_fusion", [p])
        op.begin(base, ctx)
        op.add(ExpertInput.from_theta(0, p, [0], True, theta=theta))
        return op.finish().copy()

    a, b, c = run(1), run(1), run(2)
    assert np.array_equal(a, b)
    exact = plain_arcee_fusion(torch.from_numpy(base), torch.from_numpy(theta)).numpy()
    # a sampled threshold moves the cut a little: nearly every element agrees with the exact-quantile formula
    assert 0 < np.mean(a != exact) < 0.01 and 0 < np.mean(c != exact) < 0.01
    kept = a != base
    assert 0.01 < kept.mean() < 0.5 and np.array_equal(a[kept], theta[kept])


def plain_sce_f32(b: torch.Tensor, tvs: torch.Tensor, topk: float, numel: int) -> torch.Tensor:
    """sce in torch float32 on θ₀ `b` (M,) and the stacked Δ `tvs` (K, M) of the rows read, compacted:
    w_k = Σ tvs_k² / numel, numel the whole tensor's (docs/SEMANTICS.md)."""
    if topk < 1 and tvs.shape[1]:
        mask = torch.zeros(tvs.shape[1:], dtype=torch.float32)
        var = torch.var(tvs, dim=0, unbiased=False)
        k = int(int((var != 0).sum()) * topk) if topk > 0 else 0
        if k:
            mask[torch.topk(var.abs(), k).indices] = 1
        tvs = tvs * mask
    erase = tvs.sign() == (tvs.sum(dim=0) >= 0).float() * 2 - 1
    w = (tvs * tvs).sum(dim=1) / numel
    total = float(w.sum())
    w = torch.full_like(w, 1 / len(w)) if abs(total) < 1e-6 else w / total
    erased = w[:, None] * erase
    return b + (tvs * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)


@pytest.mark.parametrize("topk", [0.5, 1.0])
def test_sce_under_a_budget_is_the_formula_on_the_rows_read_bit_for_bit(catalog, fam, tmp_path, topk) -> None:
    """Partial budget: the rows some expert read, compacted, through sce's float32 formula; θ₀ + 0.0 on the
    other rows (-0.0 there becomes +0.0, as the whole-tensor formula gives)."""
    family, names = fam
    spec = _spec("sce", names[:3], params={"select_topk": topk})
    res = catalog.merge(spec, out=tmp_path / "o", budget=0.3)
    assert res.planned_bytes <= res.budget_bytes and res.realized_bytes == res.planned_bytes
    assert 0 < res.planned_bytes < res.full_bytes
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())["manifest"]
    base = load_model(Path(family.base))
    experts = [load_model(Path(p)) for p in family.experts[:3]]
    read = _read_rows(manifest, base)
    got = load_output(tmp_path / "o")
    partial = 0
    for name, b0 in base.items():
        b = b0.float().reshape(max(1, b0.shape[0] if b0.dim() else 1), -1)
        masks = [read.get((k, name), torch.zeros(b0.shape, dtype=torch.bool)).reshape(b.shape) for k in range(3)]
        rows = torch.stack([m.any(dim=1) for m in masks]).any(dim=0)
        tvs = torch.stack([torch.where(m, e[name].float().reshape(b.shape) - b, 0.0)[rows].flatten()
                           for m, e in zip(masks, experts)])
        want = b + 0.0
        want[rows] = plain_sce_f32(b[rows].flatten(), tvs, topk, b.numel()).reshape(-1, b.shape[1])
        partial += 0 < int(rows.sum()) < rows.numel()
        assert torch.equal(got[name].float().reshape(b.shape).view(torch.int32), want.view(torch.int32)), name
    assert partial > 0
