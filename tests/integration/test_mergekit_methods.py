"""MergeKit 0.1.5 differential suite (issue 35, part A): the 7 original methods and breadcrumbs_ties, della,
della_linear, sce, nearswap, ram, ramplus_tl and arcee_fusion, merged by mergepipe and by MergeKit (its own venv,
tests/mergekit_peer.py) on one small generated F32 family.

- Deterministic methods: every output tensor within 1e-6 relative (‖mergepipe − MergeKit‖₂ ≤ 1e-6·‖MergeKit‖₂).
- DARE and DELLA draw their masks from torch's global generator in MergeKit, from keyed generators here: they are
  compared in distribution — the kept fraction (one expert, weight 1: the nonzero elements of out − θ₀), the L1
  norm that ``rescale: true`` restores, the per-element mean over seeds, and the distance to a MergeKit output no
  larger than between two MergeKit seeds (a few seeds here, more behind the `slow` marker).
- arcee_fusion on tensors below its sampling size (1e6 elements: all of the tiny family's), deterministic.

MergeKit runs in one process of its venv for all of a test's configs (`_mergekit_batch`: MergeKit's own
`run_merge`, as `mergekit-yaml` calls it), so its start-up is paid once per batch.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from mergekit_peer import VENV, ensure_mergekit, load_dir

from mergepipe_db import Catalog

pytestmark = [pytest.mark.mergekit, pytest.mark.catalog]

BLOCK = 4096
N_EXPERTS = 3
TOL = 1e-6

#: one config per method: models' parameters (in order) and global parameters (MergeKit's names)
DETERMINISTIC: dict[str, tuple[list[dict], dict]] = {
    "linear": ([{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}], {}),
    "task_arithmetic": ([{"weight": 0.5}, {"weight": 0.7}, {"weight": -0.3}], {"lambda": 0.8}),
    "ties": ([{"weight": 1.0, "density": 0.5}, {"weight": 0.5, "density": 0.3}, {"weight": 0.7, "density": 0.8}],
             {}),
    "breadcrumbs": ([{"weight": 0.5, "density": 0.7, "gamma": 0.05}, {"weight": 0.5, "density": 0.8},
                     {"weight": 0.4, "density": 0.6, "gamma": 0.1}], {}),
    "slerp": ([{}], {"t": 0.3}),
    "breadcrumbs_ties": ([{"weight": 0.6, "density": 0.7, "gamma": 0.05}, {"weight": 0.5, "density": 0.6},
                          {"weight": 0.4, "density": 0.8, "gamma": 0.02}], {"normalize": True}),
    "sce": ([{}, {}, {}], {}),
    "sce@topk": ([{}, {}, {}], {"select_topk": 0.4}),
    "nearswap": ([{}], {"t": 0.01}),
    "ram": ([{}, {}, {}], {"epsilon": 0.005}),
    "ramplus_tl": ([{}, {}, {}], {"epsilon": 0.01, "r": 0.3, "alpha": 0.5}),
    "arcee_fusion": ([{}], {}),
    # rescale: false makes DARE and DELLA deterministic at density 1 ... and density 1 keeps everything
    "dare_linear@d1": ([{"weight": 0.6}, {"weight": 0.5}, {"weight": 0.4}], {"rescale": False}),
}

#: the random drops, compared in distribution
RANDOM: dict[str, tuple[list[dict], dict]] = {
    "dare_linear": ([{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5},
                     {"weight": 0.4, "density": 0.9}], {}),
    "dare_ties": ([{"weight": 1.0, "density": 0.7}, {"weight": 0.8, "density": 0.5},
                   {"weight": 0.6, "density": 0.4}], {"normalize": True}),
    "della": ([{"weight": 1.0, "density": 0.6, "epsilon": 0.2}, {"weight": 0.8, "density": 0.5},
               {"weight": 0.6, "density": 0.4, "epsilon": 0.1}], {}),
    "della_linear": ([{"weight": 0.6, "density": 0.5, "epsilon": 0.3}, {"weight": 0.5, "density": 0.7},
                      {"weight": 0.4, "density": 0.4}], {"lambda": 0.9}),
}


def _method(key: str) -> str:
    return key.split("@")[0]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.numpy import load_file, save_file

    from mergepipe_db.demo.family import make_family

    fam = make_family(tmp_path_factory.mktemp("mk_fam"), n_experts=N_EXPERTS, preset="tiny", dtype="float32",
                      seed=35)
    # the generator's task vectors repeat |Δ| values (a few thousand distinct per tensor); at a trim's cut MergeKit
    # keeps exactly k of equal values by sort order, mergepipe all of them (docs/SEMANTICS.md, ties). Continuous
    # task vectors make an equal value at a cut as unlikely as for real fine-tunes, so the cuts agree
    base = {}
    for f in sorted(Path(fam.base).glob("*.safetensors")):
        base.update(load_file(str(f)))
    rng = np.random.default_rng(3535)
    for e in fam.experts:
        for f in sorted(Path(e).glob("*.safetensors")):
            ts = load_file(str(f))
            save_file({k: (base[k] + rng.normal(0, 0.01, base[k].shape) * rng.uniform(0.5, 2.0)).astype(np.float32)
                       for k in ts}, str(f), metadata={"format": "pt"})
    return fam


@pytest.fixture(scope="module")
def mp(family, tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    cat = Catalog.open(str(tmp_path_factory.mktemp("mk_cat") / "catalog.duckdb"))
    cat.ingest(family.base, name="base", block_bytes=BLOCK)
    for i, p in enumerate(family.experts):
        cat.ingest(p, name=f"e{i}", base="base")
    return cat


def _configs(family, key: str, table: dict, n: int | None = None) -> tuple[dict, dict]:
    """(MergeKit config, mergepipe spec) of a case."""
    models, gparams = table[key]
    models = models[:n] if n else models
    method = _method(key)
    mk = {"merge_method": method, "base_model": str(family.base),
          "models": [{"model": str(family.experts[i]), **({"parameters": p} if p else {})}
                     for i, p in enumerate(models)],
          "dtype": "float32"}
    if method in ("nearswap", "arcee_fusion", "slerp"):
        mk["models"].insert(0, {"model": str(family.base)})
    if method == "linear":  # MergeKit's linear averages every input, the base too when named: ours, the experts
        del mk["base_model"]
    if gparams:
        mk["parameters"] = dict(gparams)
    spec = {"merge_method": method, "base_model": "base",
            "models": [{"model": f"e{i}", "parameters": dict(p)} for i, p in enumerate(models)],
            "parameters": dict(gparams), "dtype": "float32"}
    return mk, spec


_DRIVER = textwrap.dedent("""
    import json, sys, yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    for cfg, out, seed in json.load(open(sys.argv[1])):
        conf = MergeConfiguration.model_validate(yaml.safe_load(open(cfg)))
        run_merge(conf, out, MergeOptions(random_seed=seed, copy_tokenizer=False, write_model_card=False,
                                          quiet=True))
""")


def _mergekit_batch(jobs: list[tuple[dict, Path, int]], work: Path) -> None:
    """Run MergeKit on each (config, out, seed) in one process of its venv."""
    ensure_mergekit()
    work.mkdir(parents=True, exist_ok=True)
    listing = []
    for i, (cfg, out, seed) in enumerate(jobs):
        p = work / f"cfg{i}.yml"
        p.write_text(yaml.safe_dump(cfg, sort_keys=False))
        listing.append([str(p), str(out), seed])
    (work / "jobs.json").write_text(json.dumps(listing))
    (work / "driver.py").write_text(_DRIVER)
    proc = subprocess.run([str(VENV / "bin" / "python"), str(work / "driver.py"), str(work / "jobs.json")],
                          capture_output=True, text=True, timeout=1200,
                          env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"MergeKit failed: {proc.stderr[-3000:]}")


def _np(tensors: dict) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in tensors.items()}


def _mp_merge(mp: Catalog, spec: dict, out: Path, seed: int = 0) -> dict[str, np.ndarray]:
    mp.merge({**spec, "seed": seed}, out=out)
    return _np(load_dir(out))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    nb = float(np.linalg.norm(b.astype(np.float64)))
    return float(np.linalg.norm((a - b).astype(np.float64))) / (nb if nb else 1.0)


def test_deterministic_methods_equal_mergekit(family, mp, tmp_path) -> None:
    """Every deterministic method (the 7 original ones with their random ones at density 1, and part A's):
    each tensor within 1e-6 relative of MergeKit's output."""
    keys = list(DETERMINISTIC)
    jobs = []
    for key in keys:
        mk, _spec = _configs(family, key, DETERMINISTIC)
        jobs.append((mk, tmp_path / f"mk-{key.replace('@', '-')}", 0))
    _mergekit_batch(jobs, tmp_path / "mk-work")
    problems = []
    for key in keys:
        _mk, spec = _configs(family, key, DETERMINISTIC)
        ours = _mp_merge(mp, spec, tmp_path / f"mp-{key.replace('@', '-')}")
        theirs = _np(load_dir(tmp_path / f"mk-{key.replace('@', '-')}"))
        assert set(ours) == set(theirs), key
        for name in sorted(theirs):
            r = _rel(ours[name], theirs[name])
            if not r <= TOL:
                problems.append(f"{key}: {name} differs by {r:.3g} relative")
        base = _np(load_dir(Path(family.base)))
        changed = sum(not np.array_equal(theirs[n], base[n]) for n in theirs)
        assert changed > 0, f"{key}: MergeKit's output equals the base: the case tests nothing"
    assert not problems, "\n".join(problems[:40])


def _one_expert(key: str) -> dict:
    """One expert, weight 1, no normalization: out − θ₀ is the sparsified task vector itself."""
    models, gparams = RANDOM[key]
    return {key: ([{**models[0], "weight": 1.0}], {k: v for k, v in gparams.items() if k != "lambda"}
                  | {"normalize": False})}


def _mergekit_random(family, work: Path, cases: list[tuple[str, list[int]]], kept: list[tuple[str, list[int]]]
                     ) -> None:
    """MergeKit's outputs of the random cases (`mk-KEY-SEED`) and of the one-expert ones (`mk1-KEY-SEED`), in one
    batch."""
    jobs = []
    for key, seeds in cases:
        mk, _spec = _configs(family, key, RANDOM)
        jobs += [(mk, work / f"mk-{key}-{s}", s) for s in seeds]
    for key, seeds in kept:
        mk, _spec = _configs(family, key, _one_expert(key))
        jobs += [(mk, work / f"mk1-{key}-{s}", s) for s in seeds]
    _mergekit_batch(jobs, work / "mk-work")


def _random_case(family, mp, work: Path, key: str, mk_seeds: list[int], mp_seeds: list[int]) -> None:
    """Distance to MergeKit no larger than between two MergeKit seeds, and the per-element means over seeds."""
    _mk, spec = _configs(family, key, RANDOM)
    theirs = [_np(load_dir(work / f"mk-{key}-{s}")) for s in mk_seeds]
    ours = [_mp_merge(mp, spec, work / f"mp-{key}-{s}", seed=s) for s in mp_seeds]
    names = sorted(theirs[0])

    def dist(a: dict, b: dict) -> float:
        return float(np.sqrt(sum(float(np.sum((a[n].astype(np.float64) - b[n]) ** 2)) for n in names)))

    # both are independent draws of the same distribution, so their expected distances to MergeKit's first seed
    # are equal; 5 % covers the spread over ~10^5 elements
    mk_mk = dist(theirs[0], theirs[1])
    assert mk_mk > 0, f"{key}: two MergeKit seeds gave the same output"
    for i, o in enumerate(ours):
        assert dist(o, theirs[0]) <= 1.05 * mk_mk, (key, i, dist(o, theirs[0]), mk_mk)
    # per-element mean over seeds: ours and MergeKit's differ as two means of that many independent draws do
    m_ours = {n: np.mean([o[n] for o in ours], axis=0) for n in names}
    m_theirs = {n: np.mean([t[n] for t in theirs], axis=0) for n in names}
    spread = mk_mk / np.sqrt(2)  # one draw's distance from the mean
    gap = dist(m_ours, m_theirs)
    expected = spread * np.sqrt(1 / len(ours) + 1 / len(theirs))
    assert gap <= 1.25 * expected, (key, gap, expected)


def _kept_fraction_case(family, mp, work: Path, key: str, seeds: list[int]) -> None:
    """One expert: the kept fraction of out − θ₀ and its L1 norm (restored by rescale: true), ours and MergeKit's."""
    _mk, spec = _configs(family, key, _one_expert(key))
    base = _np(load_dir(Path(family.base)))
    expert = _np(load_dir(Path(family.experts[0])))
    d = RANDOM[key][0][0]["density"]
    for s in seeds:
        theirs = _np(load_dir(work / f"mk1-{key}-{s}"))
        ours = _mp_merge(mp, spec, work / f"mp1-{key}-{s}", seed=s)
        for label, out in (("mergekit", theirs), ("mergepipe", ours)):
            kept = total = 0
            for n in names_2d(base):
                t = out[n] - base[n]
                kept += int(np.count_nonzero(t))
                total += t.size
                l1_full = float(np.abs(expert[n] - base[n]).astype(np.float64).sum())
                l1_out = float(np.abs(t).astype(np.float64).sum())
                # rescale: true restores the tensor's L1 norm (to float32 rounding of out − θ₀)
                assert abs(l1_out - l1_full) <= 1e-3 * l1_full, (key, label, n, l1_out, l1_full)
            assert abs(kept / total - d) < 0.01, (key, label, kept / total, d)


def names_2d(tensors: dict) -> list[str]:
    return [n for n, t in tensors.items() if t.ndim == 2]


KEPT = ["dare_linear", "della_linear"]


@pytest.fixture(scope="module")
def mk_random(family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("mk_random")
    _mergekit_random(family, work, [(k, [0, 1]) for k in RANDOM], [(k, [3]) for k in KEPT])
    return work


@pytest.mark.parametrize("key", list(RANDOM))
def test_random_drops_match_mergekit_in_distribution(family, mp, mk_random, key) -> None:
    _random_case(family, mp, mk_random, key, mk_seeds=[0, 1], mp_seeds=[0, 1])


@pytest.mark.parametrize("key", KEPT)
def test_random_drops_kept_fraction_and_l1(family, mp, mk_random, key) -> None:
    _kept_fraction_case(family, mp, mk_random, key, seeds=[3])


@pytest.mark.slow
def test_random_drops_match_mergekit_in_distribution_many_seeds(family, mp, tmp_path) -> None:
    mk_seeds, mp_seeds, kept_seeds = list(range(6)), list(range(10, 16)), [7, 8, 9]
    _mergekit_random(family, tmp_path, [(k, mk_seeds) for k in RANDOM], [(k, kept_seeds) for k in KEPT])
    for key in RANDOM:
        _random_case(family, mp, tmp_path, key, mk_seeds=mk_seeds, mp_seeds=mp_seeds)
    for key in KEPT:
        _kept_fraction_case(family, mp, tmp_path, key, seeds=kept_seeds)
