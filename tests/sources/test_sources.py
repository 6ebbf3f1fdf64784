"""Expert sources beyond full checkpoints: delta checkpoints, PEFT LoRA adapters, the packed block store,
and families that mix them — exact at full budget, budget-sound below it, and bad inputs refused cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from builders import lora_factors, materialize_lora, write_adapter, write_delta
from conftest import BLOCK
from reference_merge import assert_bytes_equal, load_model, load_output, reference_merge
from safetensors.torch import save_file

from mergepipe_db import Catalog
from mergepipe_db.cli import main
from mergepipe_db.db import schema
from mergepipe_db.errors import CoordinateMismatchError, LoraAdapterError, MergePipeError, PackError
from mergepipe_db.sources.lora import FACTOR_BLOCK

pytestmark = pytest.mark.catalog

P = "base_model.model."


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _counts(cat: Catalog) -> dict[str, int]:
    with cat.db.connect() as conn:
        return {t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                for t in schema.metadata.sorted_tables}


@pytest.fixture
def fam(catalog, tiny_family):
    catalog.ingest(tiny_family.base, name="base", block_bytes=BLOCK)
    return tiny_family


# --------------------------------------------------------------------------------------------------
# delta checkpoints and export-delta
# --------------------------------------------------------------------------------------------------


def test_delta_checkpoint_full_budget_and_zero_blocks(catalog, fam, tmp_path) -> None:
    base, e1 = load_model(fam.base), load_model(fam.experts[1])
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    deltas = {n: e1[n].float() - base[n].float() for n in names}
    deltas["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)  # all zero: never a candidate
    write_delta(tmp_path / "d", deltas)
    res = catalog.ingest(tmp_path / "d", name="d1", base="base", kind="delta")
    assert res.kind == "delta" and res.n_tensors == 4
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "d1", "parameters": {"weight": 0.7}}], "parameters": {"lambda": 0.9}}
    plan = catalog.plan(spec, budget="1.0")
    zero_idx = next(t.idx for t in plan.base_tensors if t.name == "model.layers.1.mlp.up_proj.weight")
    assert (0, zero_idx) not in plan.access
    assert plan.full_bytes == sum(d.numel() * 4 for d in deltas.values())
    out = catalog.merge(spec, out=tmp_path / "out", budget="1.0")
    assert out.realized_bytes == out.planned_bytes == plan.candidate_bytes
    expected = reference_merge("task_arithmetic", Path(fam.base), [Path(fam.base)], [{"weight": 0.7}], lam=0.9,
                               expert_deltas=[deltas])
    assert_bytes_equal(load_output(tmp_path / "out"), expected)


def test_export_delta_round_trip_is_exact(catalog, fam, tmp_path, capsys) -> None:
    catalog.ingest(fam.experts[0], name="e0", base="base")
    url = str(catalog.db.url)
    assert main(["export-delta", "e0", "--out", str(tmp_path / "dx"), "--catalog", url]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["ingest", str(tmp_path / "dx"), "--name", "dx", "--base", "base", "--kind", "delta",
                 "--catalog", url]) == 0
    spec = {"merge_method": "ties", "base_model": "base", "parameters": {},
            "models": [{"model": "e0", "parameters": {"weight": 1.0, "density": 0.5}}]}
    catalog.merge(spec, out=tmp_path / "a", budget="1.0")
    spec["models"][0]["model"] = "dx"
    catalog.merge(spec, out=tmp_path / "b", budget="1.0")
    assert_bytes_equal(load_output(tmp_path / "a"), load_output(tmp_path / "b"))
    with pytest.raises(MergePipeError, match="exists"):
        catalog.export_delta("e0", tmp_path / "dx")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_export_delta_of_scalar_and_empty_tensors(catalog, tmp_path, dtype) -> None:
    """0-d and empty tensors are exported like the others: Δ = θ − θ₀ in float32, exactly."""
    from mergepipe_db.demo.family import write_model_dir

    base = {"s": torch.tensor(1.0), "v": torch.arange(6.0), "z": torch.zeros(3, 0)}
    expert = {"s": torch.tensor(1.75), "v": torch.arange(6.0) * 3, "z": torch.zeros(3, 0)}
    for name, tensors in (("base", base), ("e0", expert)):
        write_model_dir(tmp_path / name, [(k, v.to(dtype)) for k, v in tensors.items()], config={}, shard_bytes=None)
    catalog.ingest(tmp_path / "base", name="base", block_bytes=BLOCK)
    catalog.ingest(tmp_path / "e0", name="e0", base="base")
    catalog.export_delta("e0", tmp_path / "d")
    got = load_model(tmp_path / "d")
    assert {k: tuple(v.shape) for k, v in got.items()} == {"s": (), "v": (6,), "z": (3, 0)}
    for k in base:
        assert torch.equal(got[k], expert[k].to(dtype).float() - base[k].to(dtype).float()), k


def test_export_delta_that_fails_leaves_nothing(catalog, fam, tmp_path, monkeypatch) -> None:
    """A failure while writing (here: a read error on the third tensor) leaves neither the output nor its
    partial directory behind; the same call then succeeds."""
    from mergepipe_db.io.local import RangeReader

    catalog.ingest(fam.experts[0], name="e0", base="base")
    real, calls = RangeReader.read, []

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 5:  # a full expert's Δ reads the expert's tensor, then the base's
            raise OSError("read error")
        return real(*args, **kwargs)

    monkeypatch.setattr(RangeReader, "read", failing)
    with pytest.raises(OSError, match="read error"):
        catalog.export_delta("e0", tmp_path / "d")
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.partial").exists()
    monkeypatch.setattr(RangeReader, "read", real)
    catalog.export_delta("e0", tmp_path / "d")
    assert (tmp_path / "d" / "model.safetensors").is_file() and not (tmp_path / "d.partial").exists()


def test_delta_bad_coordinates_are_refused(catalog, fam, tmp_path) -> None:
    write_delta(tmp_path / "d", {"model.norm.weight": torch.zeros(63)})
    before = _counts(catalog)
    with pytest.raises(CoordinateMismatchError, match="shape") as e:
        catalog.ingest(tmp_path / "d", name="bad", base="base", kind="delta")
    assert "\n" not in str(e.value) and _counts(catalog) == before
    with pytest.raises(MergePipeError, match="--base"):
        catalog.ingest(tmp_path / "d", name="bad", kind="delta")


# --------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------


def _tiny_peft(tmp_path: Path, **lora_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    pm = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj", "embed_tokens"], **lora_kwargs))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)  # random nonzero B (PEFT initialises B = 0)
    pm.save_pretrained(tmp_path / "lora")
    merged = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    return merged


@pytest.mark.parametrize("kwargs", [
    {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.self_attn.q_proj": 2}, "alpha_pattern": {"v_proj": 3}},
    {"r": 4, "lora_alpha": 6, "use_rslora": True},
], ids=["patterns", "rslora"])
def test_lora_full_budget_equals_peft_merge_and_unload(catalog, tmp_path, kwargs) -> None:
    merged = _tiny_peft(tmp_path, **kwargs)
    catalog.ingest(tmp_path / "base", name="base", block_bytes=1024)
    res = catalog.ingest(tmp_path / "lora", name="lora", base="base")  # kind auto-detected
    assert res.kind == "lora"
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "lora", "parameters": {"weight": 1.0}}]}
    out = catalog.merge(spec, out=tmp_path / "out", budget="1.0")
    assert out.realized_bytes == out.planned_bytes
    got = load_output(tmp_path / "out")
    assert set(got) <= set(merged)
    for name, t in got.items():
        torch.testing.assert_close(t.float(), merged[name].float(), rtol=1e-6, atol=1e-6, msg=name)
    changed = [n for n, t in got.items() if not torch.equal(t, load_model(tmp_path / "base")[n])]
    assert len(changed) == 5  # 2 q_proj, 2 v_proj, embed_tokens


def test_lora_partial_budgets_are_sound_and_replayable(catalog, fam, tmp_path) -> None:
    cfg, f = lora_factors(3)
    write_adapter(tmp_path / "a", cfg, f)
    catalog.ingest(tmp_path / "a", name="lo", base="base", kind="lora")
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "lo", "parameters": {"weight": 1.0}}]}
    full = catalog.plan(spec, budget="1.0")
    assert full.planned_bytes == full.candidate_bytes == sum(v.numel() * 2 for v in f.values())
    prev = -1
    for frac in (0.05, 0.2, 0.5, 0.8):
        plan = catalog.plan(spec, budget=str(frac))
        assert plan.planned_bytes <= plan.budget_bytes and plan.planned_bytes >= prev
        prev = plan.planned_bytes
        for (_pos, _tidx), reads in plan.access.items():
            idx = {r.block_idx for r in reads}
            assert not (idx - {FACTOR_BLOCK}) or FACTOR_BLOCK in idx  # a block never lacks its factor
    res = catalog.merge(spec, out=tmp_path / "o", budget="0.5")
    assert res.realized_bytes == res.planned_bytes <= res.budget_bytes
    catalog.replay(tmp_path / "o", out=tmp_path / "r", verify=True)


def _bad_adapter_cases():
    cfg, f = lora_factors(1)
    wrong_r = dict(f)
    wrong_r[f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(3, 64, dtype=torch.bfloat16)
    wrong_base = dict(f)
    wrong_base[f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(63, 4, dtype=torch.bfloat16)
    unknown = dict(f)
    unknown[f"{P}model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    unknown[f"{P}model.layers.9.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4, dtype=torch.bfloat16)
    return [("r", cfg, wrong_r, "r=4"), ("base", cfg, wrong_base, "do not fit"),
            ("unknown", cfg, unknown, "unknown module")]


@pytest.mark.parametrize("case", _bad_adapter_cases(), ids=lambda c: c[0])
def test_bad_lora_adapters_are_refused(catalog, fam, tmp_path, case) -> None:
    _id, cfg, f, msg = case
    write_adapter(tmp_path / "a", cfg, f)
    before = _counts(catalog)
    with pytest.raises(LoraAdapterError, match=msg) as e:
        catalog.ingest(tmp_path / "a", name="bad", base="base")
    assert "\n" not in str(e.value) and _counts(catalog) == before


def test_missing_adapter_config_is_refused(catalog, fam, tmp_path, capsys) -> None:
    _cfg, f = lora_factors(1)
    (tmp_path / "a").mkdir()
    save_file(f, str(tmp_path / "a" / "adapter_model.safetensors"))
    before = _counts(catalog)
    with pytest.raises(LoraAdapterError, match="adapter_config.json"):
        catalog.ingest(tmp_path / "a", name="bad", base="base", kind="lora")
    assert _counts(catalog) == before
    assert main(["ingest", str(tmp_path / "a"), "--base", "base", "--kind", "lora",
                 "--catalog", str(catalog.db.url)]) == 1
    err = capsys.readouterr().err.strip()
    assert "adapter_config.json" in err and "\n" not in err


# --------------------------------------------------------------------------------------------------
# packed store and mixed families
# --------------------------------------------------------------------------------------------------


def test_pack_costs_compressed_bytes_and_merges_identically(catalog, fam, tmp_path) -> None:
    catalog.ingest(fam.experts[2], name="e2", base="base")
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "e2", "parameters": {"weight": 0.8}}]}
    catalog.merge(spec, out=tmp_path / "plain", budget="1.0")
    before = catalog.plan(spec, budget="1.0")
    res = catalog.pack("e2", store=tmp_path / "store")
    assert res.blocks_packed > 0 and res.packed_bytes < res.raw_bytes
    again = catalog.pack("e2", store=tmp_path / "store")
    assert again.blocks_packed == 0  # idempotent
    after = catalog.plan(spec, budget="1.0")
    assert after.planned_bytes == before.planned_bytes - res.raw_bytes + res.packed_bytes
    out = catalog.merge(spec, out=tmp_path / "packed", budget="1.0", verify_reads=True)
    assert out.realized_bytes == out.planned_bytes == after.planned_bytes
    assert_bytes_equal(load_output(tmp_path / "packed"), load_output(tmp_path / "plain"))
    catalog.replay(tmp_path / "packed", out=tmp_path / "replayed", verify=True)
    small = catalog.merge(spec, out=tmp_path / "small", budget=f"{after.planned_bytes // 3}B")
    assert small.realized_bytes == small.planned_bytes <= after.planned_bytes // 3


def test_pack_leaves_incompressible_blocks_and_full_budget_reads_everything(catalog, tmp_path) -> None:
    """A dense float32 change leaves the low mantissa bytes random: zstd(expert XOR base) of such a block is no
    smaller than the block. pack leaves those blocks to be read from the expert's file, so budget 1.0 (the raw
    full read) still reads every candidate and equals the naive full read; a payload an earlier version stored
    although it is not smaller is ignored the same way."""
    from mergepipe_db.demo.family import write_model_dir

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 16, generator=g) * 0.02
    dense = base + torch.randn(64, 16, generator=g) * 0.02  # every element changed
    sparse = base.clone()
    sparse[::8, 3] += 0.5  # one element in a few rows: those blocks compress
    for name, w in (("base", base), ("e0", dense), ("e1", sparse)):
        write_model_dir(tmp_path / name, [("w", w)], config={}, shard_bytes=None)
    catalog.ingest(tmp_path / "base", name="base", block_bytes=64)
    spec = {"merge_method": "task_arithmetic", "base_model": "base", "models": []}
    for name, weight in (("e0", 1.0), ("e1", 0.5)):
        catalog.ingest(tmp_path / name, name=name, base="base")
        spec["models"].append({"model": name, "parameters": {"weight": weight}})
    full = catalog.plan(spec, budget="1.0")
    res = catalog.pack("e0", store=tmp_path / "store")
    assert (res.blocks_left_raw, res.blocks_packed) == (64, 0)  # every block of the dense change
    res1 = catalog.pack("e1", store=tmp_path / "store")
    assert res1.blocks_packed > 0 and res1.packed_bytes < res1.raw_bytes
    expected = reference_merge("task_arithmetic", tmp_path / "base", [tmp_path / "e0", tmp_path / "e1"],
                               [{"weight": 1.0}, {"weight": 0.5}])
    plans = [catalog.plan(spec, budget="1.0")]
    with catalog.db.connect() as conn:  # as an earlier version could store them: e1's payloads not smaller
        conn.execute(sa.update(schema.packed_block).values(clen=8192))
    plans.append(catalog.plan(spec, budget="1.0"))
    assert plans[0].planned_bytes < full.planned_bytes == plans[1].planned_bytes
    for i, budget in enumerate(("1.0", f"{full.full_bytes}B")):
        plan = catalog.plan(spec, budget=budget)
        assert plan.planned_bytes <= plan.budget_bytes == full.full_bytes
        assert plan.selected_blocks(0, 0) == full.selected_blocks(0, 0)
        out = catalog.merge(spec, out=tmp_path / f"out{i}", budget=budget, verify_reads=True)
        assert out.realized_bytes == out.planned_bytes
        assert_bytes_equal(load_output(tmp_path / f"out{i}"), expected)


def test_pack_refuses_non_full_experts(catalog, fam, tmp_path) -> None:
    write_delta(tmp_path / "d", {"model.norm.weight": torch.ones(64)})
    catalog.ingest(tmp_path / "d", name="d", base="base", kind="delta")
    with pytest.raises(PackError):
        catalog.pack("d", store=tmp_path / "s")


@pytest.mark.parametrize("family_name", ["tiny_family", "tiny_family_f16"])
def test_mixed_family_full_budget_equals_materialized_reference(catalog, request, tmp_path, family_name) -> None:
    fam = request.getfixturevalue(family_name)
    catalog.ingest(fam.base, name="base", block_bytes=BLOCK)
    base, e1 = load_model(fam.base), load_model(fam.experts[1])
    catalog.ingest(fam.experts[0], name="full0", base="base")
    dnames = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]
    deltas = {n: (e1[n].float() - base[n].float()).to(torch.float32) for n in dnames}
    write_delta(tmp_path / "d", deltas)
    catalog.ingest(tmp_path / "d", name="delta1", base="base", kind="delta")
    cfg, f = lora_factors(5, base[dnames[0]].dtype)
    write_adapter(tmp_path / "lora", cfg, f)
    catalog.ingest(tmp_path / "lora", name="lora2", base="base")
    catalog.ingest(fam.experts[2], name="packed3", base="base")
    catalog.pack("packed3", store=tmp_path / "store")
    names = ["full0", "delta1", "lora2", "packed3"]
    params = [{"weight": 0.4, "density": 0.6}, {"weight": 0.3, "density": 0.7}, {"weight": 0.5, "density": 0.5},
              {"weight": 0.2, "density": 0.8}]
    lora_delta = materialize_lora(cfg, f)
    for method in ("linear", "task_arithmetic", "ties", "dare_linear"):
        spec = {"merge_method": method, "base_model": "base", "seed": 11, "parameters": {},
                "models": [{"model": n, "parameters": p} for n, p in zip(names, params)]}
        res = catalog.merge(spec, out=tmp_path / method, budget="1.0")
        assert res.realized_bytes == res.planned_bytes
        expected = reference_merge(
            method, Path(fam.base), [Path(fam.experts[0]), Path(fam.base), Path(fam.base), Path(fam.experts[2])],
            params, seed=11, expert_keys=[catalog.checkpoint_id(n) for n in names], block_bytes=BLOCK,
            expert_deltas=[None, deltas, lora_delta, None])
        assert_bytes_equal(load_output(tmp_path / method), expected)


def test_lora_fan_in_fan_out_full_budget(catalog, fam, tmp_path) -> None:
    g = torch.Generator().manual_seed(9)
    cfg = {"r": 3, "lora_alpha": 5, "fan_in_fan_out": True}
    m = "model.layers.1.mlp.down_proj"  # base [64, 128] = [in, out] under fan_in_fan_out
    f = {f"{P}{m}.lora_A.weight": torch.randn(3, 64, generator=g), f"{P}{m}.lora_B.weight": torch.randn(128, 3,
                                                                                                      generator=g)}
    write_adapter(tmp_path / "a", cfg, f)
    catalog.ingest(tmp_path / "a", name="fif", base="base")
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "fif", "parameters": {"weight": 0.5}}]}
    res = catalog.merge(spec, out=tmp_path / "o", budget="1.0")
    assert res.realized_bytes == res.planned_bytes == (3 * 64 + 128 * 3) * 4
    expected = reference_merge("task_arithmetic", Path(fam.base), [Path(fam.base)], [{"weight": 0.5}],
                               expert_deltas=[materialize_lora(cfg, f)])
    assert_bytes_equal(load_output(tmp_path / "o"), expected)
    part = catalog.plan(spec, budget=f"{res.planned_bytes // 2}B")
    assert part.planned_bytes <= res.planned_bytes // 2
