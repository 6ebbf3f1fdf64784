"""Budgeted merge: full-budget equality with the naive full read (byte for byte), budget soundness,
determinism, the omitted-update bound, output format, atomic commit under kills, and bad specs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from builders import CASES, make_spec, reference_for
from conftest import BLOCK, ingest_family
from reference_merge import assert_bytes_equal, load_output, reference_merge

from mergepipe_db import Catalog
from mergepipe_db.db import schema
from mergepipe_db.errors import BudgetError, MergePipeError, OutputExistsError, SpecError, UnknownCheckpointError

pytestmark = pytest.mark.catalog


@pytest.mark.parametrize("method", list(CASES))
@pytest.mark.parametrize("family_name", ["tiny_family", "tiny_family_f32", "tiny_family_f16"])
@pytest.mark.parametrize("read_path", ["page_cache", "direct"])
def test_full_budget_is_bit_identical_to_naive_full_read(catalog, request, tmp_path, monkeypatch, method,
                                                         family_name, read_path) -> None:
    """Both read paths of `RangeReader.read_aligned`: a copy from the page cache (the test's files are warm,
    so the cache is what a merge would use; forced here, whatever the kernel reports) and O_DIRECT."""
    from mergepipe_db.io import local as storage

    family = request.getfixturevalue(family_name)
    names = ingest_family(catalog, family)
    monkeypatch.setattr(storage, "page_cached", lambda fd, offset, n: read_path == "page_cache")
    res = catalog.merge(make_spec(method, names), out=tmp_path / "out", budget="1.0", shard_bytes=40_000)
    assert res.realized_bytes == res.planned_bytes <= res.budget_bytes
    if read_path == "page_cache":  # every byte of full checkpoints is read by read_aligned
        assert res.cached_bytes == res.base_bytes + res.realized_bytes
    else:
        assert res.cached_bytes == 0
    expected = reference_for(catalog, family, method, names)
    assert_bytes_equal(load_output(tmp_path / "out"), expected)


@pytest.mark.parametrize("method", list(CASES))
def test_empty_tensors_are_merged_and_written(catalog, tmp_path, method) -> None:
    """Tensors with no elements ((2, 0), (0,)) between ordinary ones: written (empty) in their place, the rest
    equal to the naive full read, at full budget and at a partial one."""
    from mergepipe_db.demo.family import write_model_dir

    g = torch.Generator().manual_seed(4)
    base = {"a.weight": torch.randn(64, 40, generator=g), "b.empty": torch.zeros(2, 0),
            "c.bias": torch.randn(40, generator=g), "d.empty": torch.zeros(0),
            "e.weight": torch.randn(32, 64, generator=g)}
    paths = []
    for k, name in enumerate(("base", "e0", "e1", "e2")):
        tensors = {n: (t if k == 0 else t + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
                   for n, t in base.items()}
        write_model_dir(tmp_path / name, list(tensors.items()), config={"model_type": "llama"}, shard_bytes=6000)
        paths.append(tmp_path / name)
    catalog.ingest(paths[0], name="base", block_bytes=1024)
    names = [catalog.ingest(p, name=p.name, base="base").name for p in paths[1:]]
    for budget in ("1.0", "0.5"):
        out = tmp_path / f"out-{budget}"
        res = catalog.merge(make_spec(method, names), out=out, budget=budget)
        assert res.realized_bytes == res.planned_bytes <= res.budget_bytes
        got = load_output(out)
        assert {n: tuple(t.shape) for n, t in got.items() if t.numel() == 0} == {"b.empty": (2, 0), "d.empty": (0,)}
    n = len(CASES[method]["models"])
    case = CASES[method]
    expected = reference_merge(method, paths[0], paths[1:n + 1], [dict(m) for m in case["models"]],
                               normalize=case["parameters"].get("normalize"), lam=case["parameters"].get("lambda", 1.0),
                               t=case["parameters"].get("t"), seed=7,
                               expert_keys=[catalog.checkpoint_id(nm) for nm in names[:n]], block_bytes=1024)
    assert_bytes_equal(load_output(tmp_path / "out-1.0"), expected)


_REPORT_IMPORTS = ("import sys; from mergepipe_db import cli; rc = cli.main(sys.argv[1:]); "
                   "print(' '.join(m for m in ('torch', 'scipy.linalg') if m in sys.modules) or 'neither', "
                   "file=sys.stderr); cli.exit_now(rc)")


def test_the_catalog_imports_neither_numba_nor_the_ingest_pipeline() -> None:
    """`mergepipe merge` imports the catalog while the kernels' warm-up thread loads numba (`kernels.warmup`): an
    import of numba there (the ingest pipeline's block statistics) would make the main thread wait for it."""
    code = ("import sys, mergepipe_db.catalog; "
            "print(*(m for m in ('numba', 'mergepipe_db.pipeline.ingest') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties", "dare_ties", "dare_linear"])
def test_fused_merges_import_neither_torch_nor_scipy(catalog, catalog_url, tiny_family, tmp_path, method) -> None:
    """A `mergepipe merge` of full BF16 checkpoints with the fused operators runs without importing torch
    (~2 s of a merge's start-up; DARE draws torch.rand's uniforms with its own generator) or SciPy's BLAS
    (numba looks for it when SciPy is installed: `warmup.import_numba_without_scipy`), and still writes
    the naive full-read merge, byte for byte; the JSON result
    on stdout is complete though the process skips the interpreter's teardown (`cli.exit_now`)."""
    import yaml

    names = ingest_family(catalog, tiny_family)
    spec_path = tmp_path / "spec.yml"
    spec_path.write_text(yaml.safe_dump(make_spec(method, names)))
    env = {k: v for k, v in os.environ.items() if k != "MERGEPIPE_DEBUG"}
    done = subprocess.run([sys.executable, "-c", _REPORT_IMPORTS, "merge", str(spec_path), "--out",
                           str(tmp_path / "out"), "--catalog", catalog_url, "--quiet", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "neither"
    assert json.loads(done.stdout)["realized_bytes"] == json.loads(done.stdout)["planned_bytes"]
    assert_bytes_equal(load_output(tmp_path / "out"), reference_for(catalog, tiny_family, method, names))


@pytest.mark.parametrize("method", [m for m in CASES if m != "slerp"])
def test_unread_blocks_from_the_base_table_equal_the_computed_ones(catalog, tiny_family, tmp_path, monkeypatch,
                                                                   method) -> None:
    """At a partial budget the executor writes blocks no expert reads from the operator's base-only table
    (`executor.BaseOnly`); the output is byte for byte the one computed with every block folded."""
    from mergepipe_db.pipeline import execute as executor

    names = ingest_family(catalog, tiny_family)
    spec = make_spec(method, names)
    skipped: list[int] = []
    skippable = executor.BaseOnly.skippable

    def counting(self, plan, t):  # noqa: ANN001, ANN202
        skip = skippable(self, plan, t)
        skipped.append(0 if skip is None else int(skip.sum()))
        return skip

    monkeypatch.setattr(executor.BaseOnly, "skippable", counting)
    catalog.merge(spec, out=tmp_path / "table", budget="0.3", shard_bytes=40_000)
    assert sum(skipped) > 0
    monkeypatch.setattr(executor.BaseOnly, "skippable", lambda self, plan, t: None)
    catalog.merge(spec, out=tmp_path / "folded", budget="0.3", shard_bytes=40_000)
    assert_bytes_equal(load_output(tmp_path / "table"), load_output(tmp_path / "folded"))


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_snapshot_block_rows_equal_an_ingest_of_its_output(catalog, tiny_family, tmp_path, monkeypatch,
                                                           method) -> None:
    """The executor catalogues a snapshot's blocks as it writes them (hashes and delta statistics against the
    base), with shortcuts: blocks that are θ₀'s bytes are written from θ₀'s buffer (never copied) and not
    compared with it, and the tensor hash is fed block by block. Ingesting the output directory afterwards,
    from the files, gives the same rows."""
    from mergepipe_db.pipeline import execute as executor

    names = ingest_family(catalog, tiny_family)
    marked: list[int] = []
    out_blocks = executor.out_block_rows

    def spying(ot, data, block_bytes, base=None, unchanged=None, *args):  # noqa: ANN001, ANN002, ANN202
        marked.append(0 if unchanged is None else int(unchanged.sum()))
        return out_blocks(ot, data, block_bytes, base, unchanged, *args)

    monkeypatch.setattr(executor, "out_block_rows", spying)
    res = catalog.merge(make_spec(method, names), out=tmp_path / "out", budget="0.2", shard_bytes=40_000)
    assert sum(marked) > 0  # the shortcut was taken
    again = catalog.ingest(tmp_path / "out", name="again", base="base")
    cols = ("tensor_idx", "block_idx", "row_start", "row_stop", "offset", "nbytes", "xxh3", "delta_l2", "delta_l1",
            "delta_max", "pos_frac", "sketch")
    b, t = schema.block, schema.tensor
    with catalog.db.connect() as conn:
        snap = conn.execute(sa.select(schema.checkpoint.c.id).where(schema.checkpoint.c.name == res.checkpoint)
                            ).scalar_one()
        rows = {cid: conn.execute(sa.select(*(b.c[c] for c in cols)).where(b.c.checkpoint_id == cid)
                                  .order_by(b.c.tensor_idx, b.c.block_idx)).all()
                for cid in (snap, again.checkpoint_id)}
        tensors = {cid: conn.execute(sa.select(t.c.name, t.c.xxh3, t.c.delta_l2, t.c.equal_to_base)
                                     .where(t.c.checkpoint_id == cid).order_by(t.c.tensor_idx)).all()
                   for cid in (snap, again.checkpoint_id)}
    assert len(rows[snap]) > 0 and rows[snap] == rows[again.checkpoint_id]
    assert tensors[snap] == tensors[again.checkpoint_id]
    assert {r.equal_to_base for r in tensors[snap]} == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slerp_keeps_the_sign_of_zeros_an_expert_changed(catalog, tmp_path, dtype) -> None:
    """An expert tensor that differs from the base only where a -0.0 became +0.0 has Δ = 0 throughout, but
    slerp reads θ_k itself (θ₀·(1−t) + θ_k·t: -0.0 + +0.0 = +0.0): it is read at full budget, and the output is
    the naive full read's, zeros' signs included."""
    from mergepipe_db.demo.family import write_model_dir

    base = {"a": torch.tensor([-0.0, 1.0, -0.0, 2.0]), "b": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    expert = {"a": torch.tensor([0.0, 1.0, -0.0, 2.0]), "b": torch.tensor([1.5, 2.0, 3.0, 4.5])}
    for name, tensors in (("base", base), ("e0", expert)):
        write_model_dir(tmp_path / name, [(k, v.to(dtype)) for k, v in tensors.items()], config={}, shard_bytes=None)
    catalog.ingest(tmp_path / "base", name="base", block_bytes=BLOCK)
    catalog.ingest(tmp_path / "e0", name="e0", base="base")
    spec = {"merge_method": "slerp", "base_model": "base", "models": [{"model": "e0"}], "parameters": {"t": 0.4}}
    catalog.merge(spec, out=tmp_path / "out", budget="1.0")
    got = load_output(tmp_path / "out")
    assert_bytes_equal(got, reference_merge("slerp", tmp_path / "base", [tmp_path / "e0"], [{}], t=0.4))
    assert torch.signbit(got["a"]).tolist() == [False, False, True, False]
    # task arithmetic turns θ₀'s -0.0 into +0.0 (θ₀ + 0·λ): "a" is not the base's bytes, in the snapshot's rows
    # as in an ingest of its output
    spec = {"merge_method": "task_arithmetic", "base_model": "base", "models": [{"model": "e0",
                                                                                  "parameters": {"weight": 1.0}}]}
    res = catalog.merge(spec, out=tmp_path / "ta", budget="1.0")
    again = catalog.ingest(tmp_path / "ta", name="again", base="base")
    t = schema.tensor
    with catalog.db.connect() as conn:
        snap = conn.execute(sa.select(schema.checkpoint.c.id).where(schema.checkpoint.c.name == res.checkpoint)
                            ).scalar_one()
        equal = [dict(conn.execute(sa.select(t.c.name, t.c.equal_to_base).where(t.c.checkpoint_id == cid)).all())
                 for cid in (snap, again.checkpoint_id)]
    assert equal[0] == equal[1] == {"a": False, "b": False}


def test_plan_is_budget_sound_monotone_and_deterministic(catalog, tiny_family) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("task_arithmetic", names)
    planned = []
    for frac in (0.0, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0):
        p1 = catalog.plan(spec, budget=frac)
        p2 = catalog.plan(spec, budget=frac)
        assert p1.plan_hash == p2.plan_hash and p1.access == p2.access
        assert p1.planned_bytes <= p1.budget_bytes == int(frac * p1.full_bytes)
        planned.append(p1.planned_bytes)
        # a prefix of one ranking: every access set contains the smaller budgets' sets
    assert planned == sorted(planned) and planned[0] == 0
    assert planned[-1] == catalog.plan(spec, budget=1.0).candidate_bytes
    absolute = catalog.plan(spec, budget="20000B")
    assert absolute.budget_bytes == 20000 and absolute.planned_bytes <= 20000


def test_access_sets_are_nested_prefixes(catalog, tiny_family) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("ties", names)
    previous: set = set()
    for frac in (0.05, 0.2, 0.6, 1.0):
        p = catalog.plan(spec, budget=frac)
        current = {(pos, t, b) for pos, t in p.access for b in p.selected_blocks(pos, t)}
        assert previous <= current
        previous = current


def test_budgeted_merge_reads_exactly_the_plan_and_is_deterministic(catalog, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    spec = make_spec("dare_ties", names)
    a = catalog.merge(spec, out=tmp_path / "a", budget=0.2)
    b = catalog.merge(spec, out=tmp_path / "b", budget=0.2)
    assert a.realized_bytes == a.planned_bytes <= a.budget_bytes
    assert a.realized_bytes < a.full_bytes * 0.2 + 1
    assert a.plan_hash == b.plan_hash and a.manifest_hash == b.manifest_hash
    for shard in Path(tmp_path / "a").glob("*.safetensors"):
        assert shard.read_bytes() == (tmp_path / "b" / shard.name).read_bytes()
    with catalog.db.connect() as conn:
        per_tensor = conn.execute(sa.text(
            "SELECT SUM(bytes_read), SUM(bytes_planned) FROM reads WHERE snapshot_id = :s"),
            {"s": a.snapshot_id}).one()
    assert per_tensor[0] == per_tensor[1] == a.realized_bytes


def test_omitted_blocks_are_never_read(catalog, tiny_family, tmp_path, monkeypatch) -> None:
    from mergepipe_db.io import local as storage

    names = ingest_family(catalog, tiny_family)
    plan = catalog.plan(make_spec("task_arithmetic", names), budget=0.15)
    allowed = {}
    for e in plan.experts:
        for t in plan.base_tensors:
            for r in plan.access.get((e.position, t.idx), ()):
                allowed.setdefault(e.tensors[t.name].path, []).append((r.offset, r.offset + r.nbytes))
    expert_paths = {e.tensors[t.name].path for e in plan.experts for t in plan.base_tensors}
    seen = []
    physical = []
    real_count = storage.RangeReader._count
    real_pread = storage.RangeReader._pread_all

    def spy_count(self, path, offset, n):
        if path in expert_paths:
            seen.append((path, offset, offset + n))
        return real_count(self, path, offset, n)

    def spy_pread(self, fd, path, offset, buf, need):
        if path in expert_paths:
            physical.append((path, offset, offset + len(buf)))
        return real_pread(self, fd, path, offset, buf, need)

    monkeypatch.setattr(storage.RangeReader, "_count", spy_count)
    monkeypatch.setattr(storage.RangeReader, "_pread_all", spy_pread)
    res = catalog.merge(make_spec("task_arithmetic", names), out=tmp_path / "o", budget=0.15)
    assert sum(hi - lo for _p, lo, hi in seen) == res.realized_bytes
    page = storage.ALIGN
    for path, lo, hi in physical:  # what reaches the kernel: a requested range, at most widened to whole pages
        assert any(a - a % page <= lo and hi <= -(-b // page) * page for _p, a, b in seen if _p == path)
    for path, lo, hi in seen:  # every byte read lies inside a selected block
        covered = sorted(r for r in allowed[path] if r[0] < hi and r[1] > lo)
        pos = lo
        for a, b in covered:
            assert a <= pos
            pos = max(pos, b)
        assert pos >= hi


def test_omitted_update_bound_holds_for_additive_operators(catalog, tiny_family_f32, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family_f32)
    for method in ("task_arithmetic", "linear"):
        spec = make_spec(method, names)
        full = load_output(Path(catalog.merge(spec, out=tmp_path / f"{method}-full", budget=1.0).out))
        for frac in (0.05, 0.3):
            res = catalog.merge(spec, out=tmp_path / f"{method}-{frac}", budget=frac)
            part = load_output(Path(res.out))
            dev = sum(float(torch.sum((part[k].double() - full[k].double()) ** 2)) for k in full) ** 0.5
            assert res.bound is not None and dev <= res.bound * (1 + 1e-5) + 1e-6, (method, frac, dev, res.bound)


def test_output_directory_loads_with_transformers(catalog, tiny_family, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    names = ingest_family(catalog, tiny_family)
    res = catalog.merge(make_spec("ties", names), out=tmp_path / "merged", budget=0.5, shard_bytes=50_000)
    out = Path(res.out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (out / "config.json").is_file() and (out / "manifest.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits).all()


def test_manifest_is_deterministic_and_stored(catalog, tiny_family, tmp_path) -> None:
    from mergepipe_db.core.manifest import manifest_hash

    names = ingest_family(catalog, tiny_family)
    res = catalog.merge(make_spec("linear", names), out=tmp_path / "m", budget=0.4)
    doc = json.loads((Path(res.out) / "manifest.json").read_text())
    assert doc["manifest_hash"] == manifest_hash(doc["manifest"]) == res.manifest_hash
    m = doc["manifest"]
    assert m["plan_hash"] == res.plan_hash and m["realized"]["total"] == res.realized_bytes
    assert m["seed"] == 7 and len(m["outputs"]["tensors"]) == 21 and m["access"]
    assert "timings" not in m
    cols, rows = catalog.sql("SELECT snapshot_id, manifest FROM manifests")
    assert rows[0][0] == res.snapshot_id and json.loads(rows[0][1])["plan_hash"] == res.plan_hash


def test_snapshot_can_be_merged_again_with_lineage(catalog, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    first = catalog.merge(make_spec("linear", names), out=tmp_path / "gen1", budget=1.0)
    spec2 = {"merge_method": "task_arithmetic", "base_model": "base",
             "models": [{"model": "gen1", "parameters": {"weight": 0.5}},
                        {"model": "e0", "parameters": {"weight": 0.5}}]}
    second = catalog.merge(spec2, out=tmp_path / "gen2", budget=1.0)
    _, rows = catalog.sql("SELECT child, parent, role FROM lineage ORDER BY child, role, parent")
    assert ("gen2@1", "gen1@1", "expert") in rows and ("gen1@1", "e0", "expert") in rows
    assert second.realized_bytes > 0 and first.snapshot_id != second.snapshot_id


BAD_SPECS = {
    "unknown model": ({"merge_method": "linear", "base_model": "base",
                       "models": [{"model": "nope", "parameters": {"weight": 1}}]}, UnknownCheckpointError),
    "unknown method": ({"merge_method": "magic", "base_model": "base",
                        "models": [{"model": "e0", "parameters": {"weight": 1}}]}, SpecError),
    "density above 1": ({"merge_method": "ties", "base_model": "base",
                         "models": [{"model": "e0", "parameters": {"weight": 1, "density": 1.5}}]}, SpecError),
    "density zero": ({"merge_method": "ties", "base_model": "base",
                      "models": [{"model": "e0", "parameters": {"weight": 1, "density": 0}}]}, SpecError),
    "negative budget": ({"merge_method": "linear", "base_model": "base", "budget": "-5",
                         "models": [{"model": "e0", "parameters": {"weight": 1}}]}, BudgetError),
    "unparsable budget": ({"merge_method": "linear", "base_model": "base", "budget": "lots",
                           "models": [{"model": "e0", "parameters": {"weight": 1}}]}, BudgetError),
    "slerp of three": ({"merge_method": "slerp", "base_model": "base", "parameters": {"t": 0.5},
                        "models": [{"model": "e0"}, {"model": "e1"}]}, SpecError),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_specs_fail_cleanly_and_write_nothing(catalog, tiny_family, tmp_path, case) -> None:
    ingest_family(catalog, tiny_family)
    spec, err = BAD_SPECS[case]
    before = _tables(catalog)
    with pytest.raises(err) as ei:
        catalog.merge(spec, out=tmp_path / "out")
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".mergepipe-staging-*"))
    assert _tables(catalog) == before


def test_non_empty_out_is_refused(catalog, tiny_family, tmp_path) -> None:
    names = ingest_family(catalog, tiny_family)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        catalog.merge(make_spec("linear", names), out=out)
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def _tables(catalog: Catalog) -> dict[str, int]:
    with catalog.db.connect() as conn:
        return {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                for t in schema.metadata.sorted_tables}


def _cli(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    env.pop("MERGEPIPE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "mergepipe_db.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("point", ["planned", "tensor_written", "shards_written", "manifest_written",
                                   "catalog_committed", "published"])
def test_kill_at_each_commit_step_leaves_old_or_new_state(catalog, catalog_url, tiny_family, tmp_path,
                                                          point) -> None:
    import yaml

    names = ingest_family(catalog, tiny_family)
    spec_path = tmp_path / "spec.yml"
    spec_path.write_text(yaml.safe_dump(make_spec("ties", names, budget=0.5)))
    out = tmp_path / "out"
    killed = _cli(["merge", str(spec_path), "--out", str(out), "--catalog", catalog_url, "--quiet"],
                  {"MERGEPIPE_FAULT": point})
    assert killed.returncode == -9, killed.stderr
    _, snaps = catalog.sql("SELECT id, out_path FROM snapshots")
    if snaps:  # the catalog committed: after gc the complete output is at --out
        assert point in ("catalog_committed", "published")
        catalog.gc(dry_run=False)
        assert (out / "manifest.json").is_file()
        done = json.loads((out / "manifest.json").read_text())
        rerun_out = tmp_path / "rerun"
    else:  # old state: nothing visible, leftovers collectable
        assert not out.exists()
        catalog.gc(dry_run=False)
        done = None
        rerun_out = out
    assert not list(tmp_path.glob(".mergepipe-staging-*")) and catalog.gc(dry_run=True) == []
    ok = _cli(["merge", str(spec_path), "--out", str(rerun_out), "--catalog", catalog_url, "--quiet", "--json"])
    assert ok.returncode == 0, ok.stderr
    again = json.loads((rerun_out / "manifest.json").read_text())
    if done is not None:
        assert again["manifest_hash"] == done["manifest_hash"]


def test_cli_errors_are_one_line_exit_1(catalog_url, tmp_path) -> None:
    spec = tmp_path / "s.yml"
    spec.write_text("merge_method: linear\nbase_model: nothing\nmodels: [{model: x, parameters: {weight: 1}}]\n")
    for args in (["merge", str(spec), "--out", str(tmp_path / "o")], ["plan", str(spec), "--budget", "-1"],
                 ["ingest", str(tmp_path / "missing")], ["plan", str(tmp_path / "nospec.yml")],
                 ["sql", "DROP TABLE mp_block"]):
        r = _cli([*args, "--catalog", catalog_url])
        assert r.returncode == 1, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and r.stderr.startswith("mergepipe: error:")
    assert issubclass(BudgetError, MergePipeError)
