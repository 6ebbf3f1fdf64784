"""The synthetic checkpoint generator: layout, determinism, sharding, delta structure, loadability."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mergepipe_db.demo.family import (
    PRESETS,
    Family,
    LlamaShape,
    make_demo_spec,
    make_family,
    shape_for_bytes,
    write_model_dir,
)

TINY = PRESETS["tiny"]


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory, in file order (sharded or not)."""
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert key not in out
                out[key] = f.get_tensor(key)
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("fam"), n_experts=4, seed=0)


# --- shapes --------------------------------------------------------------------------------------


def test_tensor_specs_follow_hf_llama_order() -> None:
    specs = TINY.tensor_specs()
    names = [n for n, _ in specs]
    assert names[0] == "model.embed_tokens.weight"
    assert names[1:10] == [
        f"model.layers.0.{m}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert len(names) == 1 + 9 * TINY.num_layers + 2
    shapes = dict(specs)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 128)
    assert TINY.num_params() == sum(math.prod(s) for _, s in specs)
    tied = LlamaShape(128, 64, 128, 2, 4, 2, tie_word_embeddings=True)
    assert "lm_head.weight" not in dict(tied.tensor_specs())
    assert tied.num_params() == TINY.num_params() - 128 * 64


def test_presets_and_shape_for_bytes_sizes() -> None:
    assert TINY.nbytes("bfloat16") < 1_000_000
    assert 10e6 <= PRESETS["small"].nbytes("bfloat16") <= 20e6
    assert 1.4e9 <= PRESETS["bench"].nbytes("bfloat16") <= 1.6e9
    for target, dtype in [
        (2_000_000, "bfloat16"),
        (50_000_000, "float32"),
        (1_500_000_000, "bfloat16"),
        (16_000_000_000, "bfloat16"),
    ]:
        shape = shape_for_bytes(target, dtype)
        assert abs(shape.nbytes(dtype) / target - 1) < 0.2, (target, shape)
    with pytest.raises(ValueError):
        LlamaShape(128, 64, 128, 2, 5, 1)


def test_config_dict_is_a_llama_config() -> None:
    cfg = TINY.config_dict("bfloat16")
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]
    assert cfg["torch_dtype"] == "bfloat16" and cfg["max_position_embeddings"] == 128
    assert json.loads(json.dumps(cfg)) == cfg


# --- layout and determinism ----------------------------------------------------------------------


def test_layout(family: Family) -> None:
    assert family.base == family.root / "base"
    assert [p.name for p in family.experts] == ["expert_00", "expert_01", "expert_02", "expert_03"]
    expected = dict(TINY.tensor_specs())
    for d in (family.base, *family.experts):
        assert sorted(p.name for p in d.iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer_config.json",
        ]
        assert json.loads((d / "config.json").read_text()) == TINY.config_dict("bfloat16")
        gen = json.loads((d / "generation_config.json").read_text())
        assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
        tensors = _load(d)
        assert list(tensors) == list(expected) or sorted(tensors) == sorted(expected)
        assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_base_values(family: Family) -> None:
    base = _load(family.base)
    emb = base["model.embed_tokens.weight"].float()
    assert abs(float(emb.std()) - 0.02) < 0.002 and abs(float(emb.mean())) < 0.002
    norm = base["model.norm.weight"].float()
    assert abs(float(norm.mean()) - 1.0) < 0.02 and 0 < float(norm.std()) < 0.1


def test_same_arguments_give_identical_files(family: Family, tmp_path: Path) -> None:
    again = make_family(tmp_path / "again", n_experts=4, seed=0)
    assert _tree_hashes(again.root) == _tree_hashes(family.root)
    other = make_family(tmp_path / "other", n_experts=1, seed=1)
    assert _tree_hashes(other.base) != _tree_hashes(family.base)
    # fewer experts: a prefix of the same family
    fewer = make_family(tmp_path / "fewer", n_experts=2, seed=0)
    assert _tree_hashes(fewer.root) == {
        k: v for k, v in _tree_hashes(family.root).items() if not k.startswith(("expert_02", "expert_03"))
    }


# --- sharding ------------------------------------------------------------------------------------


def test_sharded_layout_and_values(family: Family, tmp_path: Path) -> None:
    shard_bytes = 20_000
    sharded = make_family(tmp_path / "sharded", n_experts=2, seed=0, shard_bytes=shard_bytes)
    names = [n for n, _ in TINY.tensor_specs()]
    for d, ref in ((sharded.base, family.base), (sharded.experts[1], family.experts[1])):
        assert not (d / "model.safetensors").exists()
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in d.glob("*.safetensors"))
        n = len(files)
        assert n > 2
        assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = index["weight_map"]
        assert sorted(weight_map) == sorted(names)
        assert set(weight_map.values()) == set(files)
        in_files: dict[str, list[str]] = {}
        sizes: dict[str, int] = {}
        total = 0
        for fname in files:
            with safe_open(str(d / fname), framework="pt") as f:
                keys = list(f.keys())
                assert f.metadata() == {"format": "pt"}
                nbytes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys]
            assert all(weight_map[k] == fname for k in keys)
            in_files[fname] = keys
            sizes[fname] = sum(nbytes)
            total += sizes[fname]
            assert sizes[fname] <= shard_bytes or len(keys) == 1
        assert sorted(k for ks in in_files.values() for k in ks) == sorted(names)  # each exactly once
        assert index["metadata"]["total_size"] == total == TINY.nbytes("bfloat16")
        # packed in HF order: shard i holds a contiguous run of names; the next tensor did not fit
        order = [weight_map[n] for n in names]
        assert order == sorted(order)
        first_of = {f: next(n for n in names if weight_map[n] == f) for f in files}
        spec = dict(TINY.tensor_specs())
        for a, b in zip(files, files[1:], strict=False):
            assert sizes[a] + math.prod(spec[first_of[b]]) * 2 > shard_bytes
        # values do not depend on sharding
        got, want = _load(d), _load(ref)
        assert all(_same_bytes(got[k], want[k]) for k in names)


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    fam = make_family(tmp_path, n_experts=0, shard_bytes=20_000)
    assert (fam.base / "model.safetensors.index.json").exists()
    make_family(tmp_path, n_experts=0)
    assert sorted(p.name for p in fam.base.glob("model*")) == ["model.safetensors"]


def test_write_model_dir_oversized_tensor_gets_own_shard(tmp_path: Path) -> None:
    tensors = [
        ("a", torch.zeros(10)),
        ("big", torch.zeros(100)),
        ("b", torch.zeros(10)),
        ("c", torch.zeros(5)),
    ]
    write_model_dir(tmp_path, iter(tensors), config={"model_type": "llama"}, shard_bytes=100)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 500
    assert index["weight_map"] == {
        "a": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "b": "model-00003-of-00003.safetensors",
        "c": "model-00003-of-00003.safetensors",
    }
    assert not list(tmp_path.glob("*.partial"))


# --- expert deltas -------------------------------------------------------------------------------


def test_some_expert_tensors_are_byte_identical_to_base(family: Family) -> None:
    base = _load(family.base)
    fractions = []
    for e in family.experts:
        ex = _load(e)
        same = sum(_same_bytes(base[n], ex[n]) for n in base)
        assert 1 <= same < len(base)
        fractions.append(same / len(base))
    assert 0.15 <= sum(fractions) / len(fractions) <= 0.6


def _touched(
    base: dict[str, torch.Tensor], ex: dict[str, torch.Tensor], delta_scale: float
) -> dict[str, float]:
    """Relative delta norm of the matrices an expert clearly changed."""
    out = {}
    for n, b in base.items():
        if b.dim() == 2:
            rel = float((ex[n].float() - b.float()).norm() / b.float().norm())
            if rel > delta_scale / 4:
                out[n] = rel
    return out


def test_deltas_are_concentrated_and_differ_between_experts(family: Family) -> None:
    base = _load(family.base)
    touched_sets = []
    for e in family.experts:
        ex = _load(e)
        touched = _touched(base, ex, 0.02)
        assert touched, e
        touched_sets.append(frozenset(touched))
        for n in touched:
            delta = ex[n].float() - base[n].float()
            mass = torch.stack([blk.square().sum() for blk in torch.tensor_split(delta, 10)])
            top = mass.sort(descending=True).values[:2].sum()  # top 20% of 10 row blocks
            assert float(top / mass.sum()) > 0.6, (e.name, n)
        # overall relative change of the touched tensors is of order delta_scale
        d2 = sum(float((ex[n].float() - base[n].float()).square().sum()) for n in touched)
        w2 = sum(float(base[n].float().square().sum()) for n in touched)
        assert 0.005 < math.sqrt(d2 / w2) < 0.08
    assert len(set(touched_sets)) == len(touched_sets)


def test_delta_scale_zero_gives_copies_of_base(tmp_path: Path) -> None:
    fam = make_family(tmp_path, n_experts=1, delta_scale=0.0)
    assert (fam.base / "model.safetensors").read_bytes() == (
        fam.experts[0] / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_other_dtypes(family: Family, tmp_path: Path, dtype: str) -> None:
    fam = make_family(tmp_path, n_experts=2, dtype=dtype)
    tdtype = getattr(torch, dtype)
    assert fam.dtype == dtype
    assert json.loads((fam.base / "config.json").read_text())["torch_dtype"] == dtype
    base, ex = _load(fam.base), _load(fam.experts[0])
    assert {t.dtype for t in (*base.values(), *ex.values())} == {tdtype}
    # same draws as the BF16 family, only stored in another precision
    bf16 = _load(family.base)
    assert all(
        torch.allclose(base[n].to(torch.bfloat16).float(), bf16[n].float(), rtol=0.01, atol=1e-4)
        for n in base
    )
    same = [n for n in base if _same_bytes(base[n], ex[n])]
    changed = [n for n in base if not _same_bytes(base[n], ex[n])]
    assert same and changed
    assert _touched(base, ex, 0.02)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_family(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="dtype"):
        make_family(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="n_experts"):
        make_family(tmp_path, n_experts=-1)


# --- consumers -----------------------------------------------------------------------------------


def test_demo_spec(family: Family) -> None:
    spec = make_demo_spec(family)
    assert spec["merge_method"] == "ties" and spec["budget"] == 0.25
    assert spec["base_model"] == str(family.base)
    assert [m["model"] for m in spec["models"]] == [str(p) for p in family.experts]
    assert all(m["parameters"] == {"weight": 0.25, "density": 0.5} for m in spec["models"])
    assert spec["parameters"] == {"normalize": True} and spec["dtype"] == "bfloat16" and spec["seed"] == 0
    json.dumps(spec)
    spec = make_demo_spec(family, "task_arithmetic", "1GiB", weight=[1, 2, 3, 4], lambda_=0.5, seed=7)
    assert [m["parameters"]["weight"] for m in spec["models"]] == [1, 2, 3, 4]
    assert spec["parameters"] == {"lambda": 0.5} and spec["seed"] == 7 and spec["budget"] == "1GiB"
    slerp = make_demo_spec(family, "slerp")
    assert len(slerp["models"]) == 1 and slerp["parameters"] == {"t": 0.5}


def test_transformers_loads_the_family(family: Family, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([[1, 5, 7, 9]])
    for d in (family.base, family.experts[0]):
        model = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert model.dtype == torch.bfloat16
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, 4, TINY.vocab_size) and bool(torch.isfinite(logits).all())
    tied = make_family(
        tmp_path,
        n_experts=0,
        dtype="float32",
        shard_bytes=30_000,
        preset=LlamaShape(128, 64, 128, 2, 4, 2, tie_word_embeddings=True),
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tied.base)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 4, 128)
    assert (tied.base / "model.safetensors.index.json").exists()
