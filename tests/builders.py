"""Shared builders for the tests: merge specs over the tiny families with their reference merges, delta
checkpoints and LoRA adapters written from tensors, and a plan's state in comparable form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from conftest import BLOCK
from reference_merge import reference_merge
from safetensors.torch import save_file

from mergepipe_db import Catalog
from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator
from mergepipe_db.sources.lora import lora_scale

P = "base_model.model."  # the key prefix of a PEFT adapter's tensors

CASES: dict[str, dict] = {
    "linear": {"models": [{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}], "parameters": {}},
    "task_arithmetic": {"models": [{"weight": 0.5}, {"weight": 0.7}, {"weight": -0.3}],
                        "parameters": {"lambda": 0.8}},
    "ties": {"models": [{"weight": 1.0, "density": 0.5}, {"weight": 0.5, "density": 0.3},
                        {"weight": 0.7, "density": 0.8}], "parameters": {}},
    "dare_linear": {"models": [{"weight": 0.6, "density": 0.6}, {"weight": 0.5, "density": 0.5},
                               {"weight": 0.4, "density": 0.9}], "parameters": {}},
    "dare_ties": {"models": [{"weight": 1.0, "density": 0.7}, {"weight": 0.8, "density": 0.5},
                             {"weight": 0.6, "density": 0.4}], "parameters": {"normalize": True}},
    "breadcrumbs": {"models": [{"weight": 0.5, "density": 0.7, "gamma": 0.05}, {"weight": 0.5, "density": 0.8},
                               {"weight": 0.4, "density": 0.6, "gamma": 0.1}], "parameters": {}},
    "slerp": {"models": [{}], "parameters": {"t": 0.3}},
}


def make_spec(method: str, names: list[str], *, seed: int = 7, budget=None) -> dict:
    case = CASES[method]
    models = [{"model": n, "parameters": p} for n, p in zip(names, case["models"])]
    spec = {"merge_method": method, "base_model": "base", "models": models, "parameters": dict(case["parameters"]),
            "seed": seed}
    if budget is not None:
        spec["budget"] = budget
    return spec


def reference_for(catalog: Catalog, family, method: str, names: list[str], *, seed: int = 7) -> dict:
    case = CASES[method]
    n = len(case["models"])
    params = case["parameters"]
    return reference_merge(
        method, Path(family.base), [Path(p) for p in family.experts[:n]], [dict(m) for m in case["models"]],
        normalize=params.get("normalize"), lam=params.get("lambda", 1.0), t=params.get("t"), seed=seed,
        expert_keys=[catalog.checkpoint_id(nm) for nm in names[:n]], block_bytes=BLOCK,
    )


def write_delta(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_adapter(path: Path, cfg: dict, factors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **cfg}))
    save_file({k: v.contiguous() for k, v in factors.items()}, str(path / "adapter_model.safetensors"))
    return path


def lora_factors(seed: int, dtype=torch.bfloat16) -> tuple[dict, dict[str, torch.Tensor]]:
    """A hand-written PEFT adapter for the tiny Llama: q_proj (layer 0, r 4), v_proj (layer 1, r 2 by
    rank_pattern, alpha by alpha_pattern), embed_tokens (r 4, embedding layout)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)

    cfg = {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.self_attn.v_proj": 2},
           "alpha_pattern": {"v_proj": 3}, "target_modules": ["q_proj", "v_proj", "embed_tokens"]}
    f = {
        f"{P}model.layers.0.self_attn.q_proj.lora_A.weight": rnd(4, 64),
        f"{P}model.layers.0.self_attn.q_proj.lora_B.weight": rnd(64, 4),
        f"{P}model.layers.1.self_attn.v_proj.lora_A.weight": rnd(2, 64),
        f"{P}model.layers.1.self_attn.v_proj.lora_B.weight": rnd(32, 2),
        f"{P}model.embed_tokens.lora_embedding_A": rnd(4, 128),
        f"{P}model.embed_tokens.lora_embedding_B": rnd(64, 4),
    }
    return cfg, f


def materialize_lora(cfg: dict, factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Independent ΔW per module, plain PEFT formula on whole factors."""
    out = {}
    for key, a in factors.items():
        for sa_, sb, emb in ((".lora_A.weight", ".lora_B.weight", False),
                             (".lora_embedding_A", ".lora_embedding_B", True)):
            if key.endswith(sa_):
                module = key[len(P):-len(sa_)]
                b = factors[key[:-len(sa_)] + sb]
                _r, s = lora_scale(cfg, module)
                d = b.float() @ a.float()
                out[f"{module}.weight"] = (d.T if emb or cfg.get("fan_in_fan_out") else d) * s
    return out


def plan_state(plan) -> str:
    """Everything the plan says but its bounds (repr: NaN compares equal). Reads as the byte ranges they cover
    (adjacent ones joined): a tensor every block of which is read may be one whole-tensor read unit."""
    summary = {k: v for k, v in plan.summary().items() if k != "bound"}
    return repr((plan.plan_hash, byte_ranges(plan), plan.full_selection, summary,
                 sorted(plan.bound_per_tensor or {})))


def byte_ranges(plan) -> dict:
    out = {}
    for key, reads in sorted(plan.access.items()):
        ranges: list[list[int]] = []
        for r in reads:
            if ranges and ranges[-1][1] == r.offset:
                ranges[-1][1] += r.nbytes
            else:
                ranges.append([r.offset, r.offset + r.nbytes])
        out[key] = ranges
    return out


def fold_deltas(method: str, base: np.ndarray, selected, deltas, options: dict, *, full: bool,
                rows_per_block: int) -> np.ndarray:
    """One tensor ("w", θ₀ = `base`) merged by `method` straight through its operator: expert k given as its Δ
    (`deltas[k]`) on its `selected[k]` blocks (none: nothing read). Returns a copy of the result."""
    n_blocks = -(-base.shape[0] // rows_per_block)
    ctx = TensorContext(name="w", shape=base.shape, rows_per_block=rows_per_block, n_blocks=n_blocks, seed=0)
    op = make_operator(method, [ExpertParams(f"e{k}") for k in range(len(deltas))], options=options)
    op.begin(base, ctx)
    for k, (blocks, d) in enumerate(zip(selected, deltas)):
        op.add(ExpertInput.from_delta(k, None, blocks, full, delta=d if blocks else None))
    return op.finish().copy()


def fold_stored(method: str, base: np.ndarray, selected, stored, options: dict, *, full: bool,
                rows_per_block: int) -> np.ndarray:
    """`fold_deltas` with expert k given as its stored values `stored[k]` (θ_k's BF16 bit patterns as uint16,
    or float32), read in place as the executor hands them over; the rows of blocks not in `selected[k]` hold
    whatever `stored[k]` has there (the caller puts garbage there: they were never read). The arrays may be
    written (an operator may fill the rows not read). Returns a copy of the result."""
    n_blocks = -(-base.shape[0] // rows_per_block)
    ctx = TensorContext(name="w", shape=base.shape, rows_per_block=rows_per_block, n_blocks=n_blocks, seed=0)
    op = make_operator(method, [ExpertParams(f"e{k}") for k in range(len(stored))], options=options)
    op.begin(base, ctx)
    for k, (blocks, raw) in enumerate(zip(selected, stored)):
        op.add(ExpertInput.from_raw(k, None, blocks, full, base=base, raw=raw, ctx=ctx))
    return op.finish().copy()


def stored_with_garbage(base: np.ndarray, deltas, selected, rows_per_block: int, dtype: str, seed: int):
    """θ₀ rounded to BF16 values, and each expert's stored θ_k = θ₀ + Δ_k (BF16 bit patterns as uint16, or
    float32) with garbage — NaN, ±inf, any pattern — on the rows of the blocks not in `selected[k]` (never read);
    returns (θ₀, the stored arrays, the Δ_k they give: widen(θ_k) − θ₀ on rows read, 0 elsewhere)."""
    def widen(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def bf16(a):
        return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    base = widen(bf16(base))
    g = np.random.default_rng(seed)
    stored, effective = [], []
    for blocks, d in zip(selected, deltas):
        raw = bf16(base + d) if dtype == "bf16" else (base + d).astype(np.float32)
        delta = (widen(raw) if dtype == "bf16" else raw) - base
        unread = np.ones(base.shape[0], bool)
        for b in blocks:
            unread[b * rows_per_block:(b + 1) * rows_per_block] = False
        delta[unread] = 0.0
        junk = g.integers(0, 1 << 16, (int(unread.sum()),) + base.shape[1:]).astype(np.uint16)
        if junk.size:
            junk.reshape(junk.shape[0], -1)[:, :3] = [0x7FC0, 0x7F80, 0xFF80]  # NaN, inf, -inf
        raw[unread] = junk if dtype == "bf16" else widen(junk)
        stored.append(raw)
        effective.append(delta)
    return base, stored, effective


def tile_cases(seed: int):
    """(shape, rows per block, each expert's selected blocks, θ₀, each expert's Δ on its blocks) for the
    stored-value passes' tiles of 1,024 elements: blocks of 2,048 elements (tiles read whole or not at all), blocks
    of 24 (many to a tile: tiles read in part), a first expert that reads nothing and one that reads everything."""
    g = np.random.default_rng(seed)
    for shape, rpb, selected in [((64, 256), 8, [(0, 2, 3), (3, 7), (), (1, 2, 7)]),
                                 ((300, 24), 1, [tuple(range(0, 300, 3)), tuple(range(5, 290)), (299,), ()]),
                                 ((64, 256), 8, [(), (3, 7), (0, 1, 2, 3, 4, 5, 6, 7)])]:
        base = g.standard_normal(shape).astype(np.float32)
        deltas = []
        for blocks in selected:
            d = np.zeros(shape, np.float32)
            for b in blocks:
                d[b * rpb:(b + 1) * rpb] = (g.standard_normal((rpb,) + shape[1:]) * 0.01).astype(np.float32)
            deltas.append(d)
        yield shape, rpb, selected, base, deltas


def f32_bits(a) -> np.ndarray:
    """The float32 bit patterns of `a` (int32), for bit-for-bit comparisons."""
    return np.asarray(a, np.float32).view(np.int32)
