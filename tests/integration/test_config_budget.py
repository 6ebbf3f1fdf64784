"""The byte budget on top of MergeKit configs (slices, gradients, filters, passthrough): budget soundness measured
at the storage layer, determinism, the omitted-update bound checked from outside against the full-budget merge,
the manifest (spec text verbatim, per-tensor parameters) and replay to the same bytes, and bad configs refused
with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from mergepipe_db.errors import SpecError

pytestmark = pytest.mark.catalog

TA = """
merge_method: task_arithmetic
base_model: base
slices:
  - sources:
      - {model: base, layer_range: [0, 3]}
      - model: e0
        layer_range: [0, 3]
        parameters:
          weight: [{filter: mlp, value: [0.2, 1.0]}, {value: 0.6}]
      - {model: e1, layer_range: [0, 3], parameters: {weight: [1.0, 0.1]}}
  - sources:
      - {model: base, layer_range: [3, 4]}
      - {model: e0, layer_range: [3, 4]}
      - {model: e1, layer_range: [3, 4]}
    parameters:
      weight: 0.3
parameters:
  lambda: [0.5, 1.5]
dtype: float32
"""

TIES = """
merge_method: ties
base_model: base
models:
  - model: base
  - model: e0
    parameters: {density: [0.9, 0.2], weight: [0.3, 0.8]}
  - model: e1
parameters: {weight: 0.5, density: 0.6}
dtype: float32
"""

PASSTHROUGH = """
merge_method: passthrough
slices:
  - sources: [{model: base, layer_range: [0, 3]}]
  - sources: [{model: e0, layer_range: [1, 4]}]
  - sources: [{model: base, layer_range: [2, 3]}]
"""


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory):
    from conftest import fresh_catalog_url

    from mergepipe_db import Catalog
    from mergepipe_db.demo.family import LlamaShape, make_family

    root = tmp_path_factory.mktemp("cfgbudget")
    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2)
    family = make_family(root / "fam", n_experts=2, preset=shape, dtype="float32", seed=5)
    with fresh_catalog_url(root, "catalog") as url:
        cat = Catalog.open(url)
        cat.ingest(family.base, name="base", block_bytes=2048)
        for i, e in enumerate(family.experts):
            cat.ingest(e, name=f"e{i}", base="base", block_bytes=2048)
        yield root, family, cat


def _spec(root: Path, name: str, text: str) -> Path:
    p = root / f"{name}.yml"
    p.write_text(text)
    return p


def _load(out: Path) -> dict[str, np.ndarray]:
    t: dict[str, np.ndarray] = {}
    for f in sorted(out.glob("*.safetensors")):
        t.update(load_file(str(f)))
    return t


@pytest.mark.parametrize("name", ["ta", "ties"])
def test_budget_soundness_determinism_and_full_budget(fam, name: str) -> None:
    root, _family, cat = fam
    spec = _spec(root, name, {"ta": TA, "ties": TIES}[name])
    p1, p2 = cat.plan(str(spec), budget=0.3), cat.plan(str(spec), budget=0.3)
    assert p1.plan_hash == p2.plan_hash and p1.access == p2.access
    assert 0 < p1.planned_bytes <= p1.budget_bytes
    part = cat.merge(str(spec), out=root / f"{name}-part", budget=0.3)
    assert part.realized_bytes == part.planned_bytes == p1.planned_bytes <= part.budget_bytes
    full = cat.merge(str(spec), out=root / f"{name}-full", budget=1.0)
    assert full.realized_bytes == full.planned_bytes > part.planned_bytes
    if name == "ta":
        # omitted-update bound (task arithmetic is additive), checked against the full-budget output
        a, b = _load(root / f"{name}-part"), _load(root / f"{name}-full")
        dev = float(np.sqrt(sum(float(np.sum((a[n].astype(np.float64) - b[n]) ** 2)) for n in a)))
        assert part.bound is not None and dev <= part.bound * (1 + 1e-5) + 1e-6
        assert dev > 0


def test_manifest_holds_the_text_and_parameters_and_replay_gives_the_same_bytes(fam) -> None:
    root, _family, cat = fam
    spec = _spec(root, "ta-replay", TA)
    r = cat.merge(str(spec), out=root / "ta-rec", budget=0.5)
    doc = json.loads((root / "ta-rec" / "manifest.json").read_text())["manifest"]
    assert doc["config"]["text"] == TA
    tensors = {t[0]: t for t in doc["config"]["recipe"]["tensors"]}
    mlp0 = tensors["model.layers.0.mlp.up_proj.weight"]
    assert [p["weight"] for _pos, _n, p in mlp0[2]] == [0.2, 1.0] and mlp0[3] == {"lambda": 0.5}
    assert [p["weight"] for _pos, _n, p in tensors["model.layers.3.self_attn.q_proj.weight"][2]] == [0.3, 0.3]
    assert (root / "ta-rec" / "mergekit_config.yml").read_text() == TA
    card = (root / "ta-rec" / "README.md").read_text()
    assert card.startswith("---\n") and "- mergekit" in card and "library_name: transformers" in card
    rep = cat.replay(str(root / "ta-rec" / "manifest.json"), out=root / "ta-rep")
    assert rep.plan_hash == r.plan_hash and rep.realized_bytes == r.realized_bytes
    for f in sorted((root / "ta-rec").glob("*.safetensors")):
        assert f.read_bytes() == (root / "ta-rep" / f.name).read_bytes()


def test_passthrough_reads_no_expert_bytes_and_copies_layers(fam) -> None:
    root, family, cat = fam
    spec = _spec(root, "pt", PASSTHROUGH)
    r = cat.merge(str(spec), out=root / "pt-out", budget=0.0)
    assert r.realized_bytes == r.planned_bytes == 0
    out, base, e0 = _load(root / "pt-out"), _load(family.base), _load(family.experts[0])
    assert json.loads((root / "pt-out" / "config.json").read_text())["num_hidden_layers"] == 7
    for s in ("mlp.up_proj.weight", "self_attn.k_proj.weight", "input_layernorm.weight"):
        for out_l, (src, src_l) in enumerate([(base, 0), (base, 1), (base, 2), (e0, 1), (e0, 2), (e0, 3), (base, 2)]):
            assert out[f"model.layers.{out_l}.{s}"].tobytes() == src[f"model.layers.{src_l}.{s}"].tobytes()
    assert out["lm_head.weight"].tobytes() == base["lm_head.weight"].tobytes()
    # the catalog's record of the merge names the source layer of every output layer
    [[text]] = cat.sql(f"SELECT manifest FROM mp_manifest WHERE snapshot_id = '{r.snapshot_id}'")[1]
    layers = json.loads(text)["config"]["layers"]
    assert layers == [[["base", 0]], [["base", 1]], [["base", 2]], [["e0", 1]], [["e0", 2]], [["e0", 3]],
                      [["base", 2]]]
    [[conf]] = cat.sql(f"SELECT config FROM mp_checkpoint WHERE id = '{r.snapshot_id}'")[1]
    assert json.loads(conf)["num_hidden_layers"] == 7  # the catalogued output's config, as written
    edges = {(e["parent"], e["role"]) for e in cat.lineage(r.snapshot_id)["edges"]}
    assert {p for p, _r in edges} == {cat.checkpoint_id("base"), cat.checkpoint_id("e0")}


@pytest.mark.parametrize(("text", "path"), [
    (TA.replace("[3, 4]", "[3, 5]"), "slices[1].sources[0].layer_range"),
    (PASSTHROUGH.replace("[1, 4]}]", "[1, 4]}, {model: base, layer_range: [0, 3]}]"), "slices[1].sources"),
])
def test_bad_configs_write_nothing(fam, text: str, path: str) -> None:
    root, _family, cat = fam
    before = cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1]
    spec = _spec(root, "bad", text)
    with pytest.raises(SpecError) as ei:
        cat.merge(str(spec), out=root / "bad-out")
    assert path in str(ei.value) and len(str(ei.value).splitlines()) == 1
    assert not (root / "bad-out").exists()
    assert cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1] == before


def test_per_tensor_weights_enter_the_planner_scores(fam) -> None:
    """e0's weight is 0 on the MLP tensors (a filter) and 1 elsewhere: under a budget below the other tensors'
    bytes, the ranking (scores |c|·‖Δ‖ with each tensor's own c) selects no MLP block."""
    root, _family, cat = fam
    spec = _spec(root, "zero-mlp", """
merge_method: task_arithmetic
base_model: base
models:
  - model: e0
    parameters:
      weight: [{filter: mlp, value: 0.0}, {value: 1.0}]
""")
    plan = cat.plan(str(spec), budget=0.3)
    names = {t.idx: t.name for t in plan.base_tensors}
    chosen = [names[tidx] for (_pos, tidx) in plan.access]
    assert chosen and not any(".mlp." in n for n in chosen)
    assert any(".self_attn." in n for n in chosen)


def test_linear_without_base_of_paths_not_yet_catalogued(fam, tmp_path: Path) -> None:
    """MergeKit's usual linear form, models given by paths the catalog has never seen: the first is ingested,
    the others against it, and the result is the plain weighted average of the models."""
    from conftest import fresh_catalog_url

    from mergepipe_db import Catalog

    _root, family, _cat = fam
    text = (f"merge_method: linear\nmodels:\n  - model: {family.experts[0]}\n    parameters: {{weight: 0.25}}\n"
            f"  - model: {family.experts[1]}\n    parameters: {{weight: [0.5, 1.5]}}\ndtype: float32\n")
    spec = _spec(tmp_path, "lin", text)
    with fresh_catalog_url(tmp_path, "fresh") as url:
        res = Catalog.open(url).merge(str(spec), out=tmp_path / "lin-out")
    assert res.realized_bytes == res.planned_bytes
    out, a, b = _load(tmp_path / "lin-out"), _load(family.experts[0]), _load(family.experts[1])
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"):
        layer = int(name.split(".")[2]) if ".layers." in name else None
        w1 = 0.5 if layer is None else 0.5 + (1.5 - 0.5) * layer / 3
        want = (a[name].astype(np.float64) * 0.25 + b[name] * w1) / (0.25 + w1)
        np.testing.assert_allclose(out[name], want, rtol=2e-6, atol=1e-7)


#: e0 is read at other layers than the base's in both slices (output layers 0-3: e0's 2, 3, 0, 1), e1 at the
#: base's in the first slice and one layer back in the second (output layers 2, 3: e1's 1, 2)
OFFSET = """
merge_method: task_arithmetic
base_model: base
slices:
  - sources:
      - {model: base, layer_range: [0, 2]}
      - {model: e0, layer_range: [2, 4], parameters: {weight: 0.7}}
      - {model: e1, layer_range: [0, 2], parameters: {weight: 0.4}}
  - sources:
      - {model: base, layer_range: [2, 4]}
      - {model: e0, layer_range: [0, 2]}
      - {model: e1, layer_range: [1, 3]}
    parameters: {weight: 0.5}
dtype: float32
"""


def _offset_expected(plan, family) -> dict[str, np.ndarray]:
    """The plan's output, plainly: θ₀ is the base's layer of the output tensor's slice, each expert adds
    w·(θ_k[its own layer] − θ₀) on the rows of the blocks the plan reads (a whole-tensor read: every row)."""
    base, ex = _load(family.base), [_load(family.experts[0]), _load(family.experts[1])]
    out = {}
    for i, r in enumerate(plan.recipe.tensors):
        theta0 = base[r.base[1]].astype(np.float64)
        acc = theta0.copy()
        t = plan.base_tensors[i]
        for pos, src, mp in r.inputs:
            reads = plan.access.get((pos, i), ())
            rows = np.zeros(theta0.shape[0] if theta0.ndim else 1, bool)
            for rd in reads:
                if rd.block_idx < 0:
                    rows[:] = True
                else:
                    rows[rd.block_idx * t.rows_per_block:(rd.block_idx + 1) * t.rows_per_block] = True
            delta = ex[pos][src].astype(np.float64) - theta0
            acc[rows] += mp["weight"] * delta[rows]
        out[r.name] = acc
    return out


def test_offset_layer_ranges_under_a_budget(fam, byte_reads) -> None:  # noqa: ANN001 - store_reads.ReadLog
    """A slice whose sources have different layer ranges: the renumbered inputs (e0 everywhere, e1 in the second
    slice) are read whole as θ; planned <= budget, realized == planned == the bytes the store served for each
    expert's files (`store_reads.merge_counted`), deterministic; the output is the plan's selection applied
    plainly (numpy, here); at 1.0 every candidate is read once."""
    from store_reads import catalogued_files, merge_counted

    root, family, cat = fam
    spec = _spec(root, "offset", OFFSET)
    p1, p2 = cat.plan(str(spec), budget=0.3), cat.plan(str(spec), budget=0.3)
    assert p1.plan_hash == p2.plan_hash and p1.access == p2.access
    assert 0 < p1.planned_bytes <= p1.budget_bytes
    renumbered = p1.recipe.renumbered()
    names = [t.name for t in p1.base_tensors]
    assert {(p, names[i].split(".")[2]) for p, i in renumbered if ".layers." in names[i]} == {
        (0, "0"), (0, "1"), (0, "2"), (0, "3"), (1, "2"), (1, "3")}
    assert all(r.block_idx == -1 for k, reads in p1.access.items() if k in renumbered for r in reads)
    assert any(k in renumbered for k in p1.access) and any(k not in renumbered for k in p1.access)
    assert any(k not in p1.access for k in renumbered)  # 0.3 does not hold every renumbered tensor
    files = catalogued_files(cat)
    for budget, out in ((0.3, "offset-part"), (1.0, "offset-full")):
        r, plan, _manifest = merge_counted(cat, byte_reads, files, str(spec), root / out, budget)
        assert r.realized_bytes == r.planned_bytes <= r.budget_bytes
        if budget == 0.3:
            assert r.planned_bytes == p1.planned_bytes and plan.plan_hash == p1.plan_hash
        else:
            # every candidate (blocks with Δ ≠ 0; the renumbered tensors whole) is read, once
            assert r.planned_bytes == plan.candidate_bytes > p1.planned_bytes
            assert all(plan.full_selection.values()) and renumbered <= set(plan.access)
        got, want = _load(root / out), _offset_expected(plan, family)
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
    rep = cat.replay(str(root / "offset-part" / "manifest.json"), out=root / "offset-rep")
    assert rep.plan_hash == p1.plan_hash
    for f in sorted((root / "offset-part").glob("*.safetensors")):
        assert f.read_bytes() == (root / "offset-rep" / f.name).read_bytes()


def test_a_delta_expert_at_other_layers_than_the_base_is_refused(fam, tmp_path: Path) -> None:
    """A delta checkpoint holds Δ against the base's tensor of the same name: read at other layers it cannot
    give θ_k, so the config is refused, naming the source's layer_range, and nothing is written."""
    from safetensors.numpy import save_file

    root, family, cat = fam
    base, e0 = _load(family.base), _load(family.experts[0])
    (tmp_path / "d").mkdir()
    save_file({n: e0[n] - base[n] for n in base}, str(tmp_path / "d" / "model.safetensors"))
    cat.ingest(tmp_path / "d", name="d0", base="base", kind="delta", block_bytes=2048)
    before = cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1]
    spec = _spec(tmp_path, "delta-offset", OFFSET.replace("e0", "d0"))
    with pytest.raises(SpecError) as ei:
        cat.merge(str(spec), out=tmp_path / "out", budget=1.0)
    assert "slices[0].sources[1].layer_range" in str(ei.value) and "delta" in str(ei.value)
    assert len(str(ei.value).splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert cat.sql("SELECT COUNT(*) FROM mp_snapshot")[1] == before
    # the same delta expert at the base's layers is merged
    same = OFFSET.replace("e0", "d0").replace("{model: d0, layer_range: [2, 4]", "{model: d0, layer_range: [0, 2]")
    same = same.replace("{model: d0, layer_range: [0, 2]}", "{model: d0, layer_range: [2, 4]}")
    r = cat.merge(str(_spec(tmp_path, "delta-same", same)), out=tmp_path / "ok", budget=1.0)
    assert r.realized_bytes == r.planned_bytes > 0


def test_a_lora_adapter_at_other_layers_than_the_base_is_refused(fam, tmp_path: Path) -> None:
    """A LoRA adapter holds Δ against the base's tensors of the same names: a config reading it at other layers
    is refused, naming the source, with nothing written."""
    from tests.golden.cases import write_lora

    root, family, cat = fam
    write_lora(tmp_path / "lora", family.base, dtype="float32")
    cat.ingest(tmp_path / "lora", name="l0", base="base", kind="lora")
    spec = _spec(tmp_path, "lora-offset", OFFSET.replace("e0", "l0"))
    with pytest.raises(SpecError) as ei:
        cat.merge(str(spec), out=tmp_path / "out", budget=1.0)
    assert "slices[0].sources[1]" in str(ei.value) and "l0" in str(ei.value)
    assert len(str(ei.value).splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_packed_expert_at_other_layers_is_read_whole_from_its_file(fam, tmp_path: Path, byte_reads) -> None:  # noqa: ANN001
    """A packed expert (blocks zstd(θ_k XOR θ_base) of the same-named tensors) read at other layers than the
    base's: its renumbered tensors are whole-tensor reads of its own file (uncompressed bytes), its other
    tensors packed blocks; at 1.0 the output is the unpacked merge's, byte for byte."""
    from safetensors.numpy import save_file
    from store_reads import catalogued_files, merge_counted

    root, family, cat = fam
    p1 = {n: (v * np.float32(1.001) if n == "lm_head.weight" else v) for n, v in _load(family.experts[1]).items()}
    (tmp_path / "p1").mkdir()
    save_file(p1, str(tmp_path / "p1" / "model.safetensors"))  # e1 with another LM head: new content
    cat.ingest(tmp_path / "p1", name="p1", base="base", block_bytes=2048)
    cat.pack("p1", store=tmp_path / "store")
    text = OFFSET.replace("e1", "p1")
    spec = _spec(tmp_path, "packed-offset", text)
    plan = cat.plan(str(spec), budget=1.0)
    renumbered = plan.recipe.renumbered()
    whole = {k for k, reads in plan.access.items() if k[0] == 1 and all(r.block_idx == -1 for r in reads)}
    assert whole == {k for k in renumbered if k[0] == 1} and whole
    for (pos, i), reads in plan.access.items():
        if pos == 1 and (pos, i) in renumbered:
            assert [r.nbytes for r in reads] == [plan.experts[1].tensors[plan.base_tensors[i].name].nbytes]
    r = cat.merge(str(spec), out=tmp_path / "full", budget=1.0)
    assert r.realized_bytes == r.planned_bytes == plan.planned_bytes
    ref = cat.merge(str(_spec(tmp_path, "unpacked", OFFSET)), out=tmp_path / "ref", budget=1.0)
    a, b = _load(tmp_path / "full"), _load(tmp_path / "ref")
    assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a if n != "lm_head.weight")
    assert r.planned_bytes < ref.planned_bytes  # the packed blocks cost less than the raw ones
    part, _plan, _manifest = merge_counted(cat, byte_reads, catalogued_files(cat), str(spec), tmp_path / "part", 0.3)
    assert part.realized_bytes == part.planned_bytes <= part.budget_bytes


LINEAR_BASE_LISTED = """
merge_method: linear
base_model: base
models:
  - {model: base, parameters: {weight: 1.0}}
  - {model: EXPERT, parameters: {weight: 0.5}}
  - {model: e1, parameters: {weight: 0.25}}
dtype: float32
"""


def test_a_delta_expert_or_adapter_lacking_layers_is_delta_zero_there(fam, tmp_path: Path) -> None:
    """A delta checkpoint holds Δ only where it has a tensor, a LoRA adapter only on its target modules: through
    a config (here MergeKit's style, the base listed among linear's models) each has the base's layers and
    Δ = 0 on the tensors it lacks, as in a plain spec: the same bytes as the full checkpoint base + Δ."""
    from safetensors.numpy import save_file

    from tests.golden.cases import write_lora

    root, family, cat = fam
    base, e0 = _load(family.base), _load(family.experts[0])
    kept = [n for n in base if ".layers.0." in n or ".layers.1." in n]  # layers 2 and 3 absent: Δ = 0
    (tmp_path / "d").mkdir()
    save_file({n: e0[n] - base[n] for n in kept}, str(tmp_path / "d" / "model.safetensors"))
    cat.ingest(tmp_path / "d", name="dpart", base="base", kind="delta", block_bytes=2048)
    (tmp_path / "f").mkdir()
    full = {n: (base[n] + (e0[n] - base[n])) if n in kept else base[n] for n in base}
    save_file(full, str(tmp_path / "f" / "model.safetensors"))
    for extra in family.base.glob("*.json"):
        (tmp_path / "f" / extra.name).write_bytes(extra.read_bytes())
    cat.ingest(tmp_path / "f", name="fpart", base="base", block_bytes=2048)
    outs = {}
    for name in ("dpart", "fpart"):
        spec = _spec(tmp_path, f"lin-{name}", LINEAR_BASE_LISTED.replace("EXPERT", name))
        r = cat.merge(str(spec), out=tmp_path / f"out-{name}", budget=1.0)
        assert r.realized_bytes == r.planned_bytes
        outs[name] = _load(tmp_path / f"out-{name}")
    assert outs["dpart"].keys() == outs["fpart"].keys() == base.keys()
    for n in base:
        assert outs["dpart"][n].tobytes() == outs["fpart"][n].tobytes(), n
    # a LoRA adapter (its target modules only) in the same config is merged, not refused
    write_lora(tmp_path / "lora", family.base, dtype="float32")
    cfg_path = tmp_path / "lora" / "adapter_config.json"  # another alpha: not the adapter another test ingested
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "lora_alpha": 3}))
    cat.ingest(tmp_path / "lora", name="lpart", base="base", kind="lora")
    spec = _spec(tmp_path, "lin-lora", LINEAR_BASE_LISTED.replace("EXPERT", "lpart"))
    r = cat.merge(str(spec), out=tmp_path / "out-lora", budget=1.0)
    assert r.realized_bytes == r.planned_bytes > 0
    assert _load(tmp_path / "out-lora").keys() == base.keys()
