"""Sanity tests of the reference merge (the oracle) on small hand-made checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from reference_merge import (
    assert_bytes_equal,
    dare_keep_mask,
    load_model,
    load_output,
    reference_merge,
    row_blocks,
)
from safetensors.torch import save_file


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _model(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g).to(dtype),
        "layer.0.weight": torch.randn(6, 5, generator=g).to(dtype),
        "layer.0.bias": torch.randn(5, generator=g).to(dtype),
        "scale": torch.randn((), generator=g).to(dtype),
    }


@pytest.fixture()
def three_models(tmp_path: Path) -> tuple[Path, Path, Path]:
    return (
        _save(tmp_path / "base.safetensors", _model(0)),
        _save(tmp_path / "a.safetensors", _model(1)),
        _save(tmp_path / "b.safetensors", _model(2)),
    )


# --------------------------------------------------------------------------------------------------
# I/O and comparison
# --------------------------------------------------------------------------------------------------


def test_load_model_layouts_agree(tmp_path: Path) -> None:
    tensors = _model(3)
    single = _save(tmp_path / "single.safetensors", tensors)

    hf_single = tmp_path / "hf_single"
    hf_single.mkdir()
    _save(hf_single / "model.safetensors", tensors)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        _save(sharded / shard, {n: tensors[n] for n in shard_names})
        weight_map.update({n: shard for n in shard_names})
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    assert_bytes_equal(load_model(single), tensors)
    assert_bytes_equal(load_model(hf_single), tensors)
    assert_bytes_equal(load_model(sharded), tensors)
    assert_bytes_equal(load_output(sharded), tensors)
    assert load_model(single)["embed.weight"].dtype == torch.bfloat16


def test_assert_bytes_equal_reports_first_difference() -> None:
    a = {"x": torch.zeros(4), "y": torch.zeros(3, 2)}
    b = {"x": torch.zeros(4), "y": torch.zeros(3, 2)}
    assert_bytes_equal(a, b)

    b["y"] = b["y"].clone()
    b["y"][0, 1] = 1.0
    b["y"][2, 0] = 2.0
    with pytest.raises(AssertionError, match=r"'y'.*2 of 6"):
        assert_bytes_equal(a, b)

    # +0.0 and -0.0 compare equal as numbers but not as bytes.
    with pytest.raises(AssertionError, match=r"'x'.*1 of 4"):
        assert_bytes_equal(a, {"x": torch.tensor([0.0, -0.0, 0.0, 0.0]), "y": a["y"]})
    with pytest.raises(AssertionError, match="dtype"):
        assert_bytes_equal(a, {"x": torch.zeros(4, dtype=torch.bfloat16), "y": a["y"]})
    with pytest.raises(AssertionError, match="shape"):
        assert_bytes_equal(a, {"x": torch.zeros(2, 2), "y": a["y"]})
    with pytest.raises(AssertionError, match="names"):
        assert_bytes_equal(a, {"x": a["x"]})


# --------------------------------------------------------------------------------------------------
# linear / task arithmetic
# --------------------------------------------------------------------------------------------------


def test_linear_of_identical_models_is_the_model(tmp_path: Path, three_models) -> None:
    base, a, _ = three_models
    a_copy = _save(tmp_path / "a_copy.safetensors", load_model(a))
    for w in ([0.5, 0.5], [1.0, 1.0], [3.0, 3.0]):
        out = reference_merge("linear", base, [a, a_copy], [{"weight": w[0]}, {"weight": w[1]}])
        assert_bytes_equal(out, load_model(a))
    # Unnormalized with weights summing to 1 in a lossless way is the model as well.
    out = reference_merge("linear", base, [a, a_copy], [{"weight": 0.5}, {"weight": 0.5}], normalize=False)
    assert_bytes_equal(out, load_model(a))


def test_linear_matches_hand_formula(three_models) -> None:
    base, a, b = three_models
    out = reference_merge("linear", base, [a, b], [{"weight": 0.3}, {"weight": 0.9}])
    ta, tb = load_model(a), load_model(b)
    for name, got in out.items():
        acc = torch.zeros_like(ta[name], dtype=torch.float32)
        acc = acc + ta[name].float() * 0.3
        acc = acc + tb[name].float() * 0.9
        expected = (acc / (0.3 + 0.9)).to(torch.bfloat16)
        assert_bytes_equal({name: got}, {name: expected})


def test_linear_weight_sum_near_zero_is_not_normalized(three_models) -> None:
    base, a, b = three_models
    params = [{"weight": 1.0}, {"weight": -1.0}]
    assert_bytes_equal(
        reference_merge("linear", base, [a, b], params),
        reference_merge("linear", base, [a, b], params, normalize=False),
    )


def test_task_arithmetic_weight_zero_is_base(three_models) -> None:
    base, a, b = three_models
    out = reference_merge("task_arithmetic", base, [a, b], [{"weight": 0.0}, {"weight": 0.0}])
    assert_bytes_equal(out, load_model(base))
    out = reference_merge("task_arithmetic", base, [a], [{"weight": 0.7}], lam=0.0)
    assert_bytes_equal(out, load_model(base))


def test_task_arithmetic_single_expert_weight_one_recovers_expert_in_float32(tmp_path: Path) -> None:
    # bf16 values are exact in float32 and their differences are exact too (small exponents range),
    # so base + (expert - base) == expert exactly.
    base = _save(tmp_path / "base.safetensors", _model(0))
    a = _save(tmp_path / "a.safetensors", _model(1))
    out = reference_merge("task_arithmetic", base, [a], [{"weight": 1.0}], out_dtype=torch.float32)
    expected = {k: v.float() for k, v in load_model(a).items()}
    for name in out:
        assert torch.allclose(out[name], expected[name], rtol=0, atol=1e-6)
    assert all(v.dtype == torch.float32 for v in out.values())


def test_out_dtype_defaults_to_base_dtype(tmp_path: Path) -> None:
    base = _save(tmp_path / "base.safetensors", _model(0, torch.float16))
    a = _save(tmp_path / "a.safetensors", _model(1, torch.bfloat16))
    out = reference_merge("task_arithmetic", base, [a], [{"weight": 0.5}])
    assert all(v.dtype == torch.float16 for v in out.values())


# --------------------------------------------------------------------------------------------------
# TIES
# --------------------------------------------------------------------------------------------------


def _one_d(tmp_path: Path, name: str, values: list[float]) -> Path:
    return _save(tmp_path / f"{name}.safetensors", {"v": torch.tensor(values, dtype=torch.float32)})


def test_ties_by_hand(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [10.0, 10.0, 10.0, 10.0])
    a = _one_d(tmp_path, "a", [11.0, 8.0, 13.0, 9.5])  # Δ_a = [1, -2, 3, -0.5]
    b = _one_d(tmp_path, "b", [9.0, 11.0, 12.0, 10.5])  # Δ_b = [-1, 1, 2, 0.5]
    params = [{"weight": 1.0, "density": 0.5}, {"weight": 2.0}]
    # Trim a: k = 2, τ = 2 -> T_a = [0, -2, 3, 0];  D_b = [-2, 2, 4, 1]
    # S = [-2, 0, 7, 1] -> s = [-1, +1, +1, +1]
    # keep_a = [F, F, T, F]; keep_b = [T, T, T, T]
    # mixed = [-2, 2, 7, 1]; div = [2, 2, 3, 2]
    out = reference_merge("ties", base, [a, b], params, normalize=False)["v"]
    assert out.tolist() == [8.0, 12.0, 17.0, 11.0]
    out = reference_merge("ties", base, [a, b], params)["v"]
    expected = torch.tensor([10.0, 10.0, 10.0, 10.0]) + torch.tensor([-2.0, 2.0, 7.0, 1.0]) / torch.tensor(
        [2.0, 2.0, 3.0, 2.0]
    )
    assert torch.equal(out, expected)
    assert out.tolist()[:2] == [9.0, 11.0] and out.tolist()[3] == 10.5
    # λ scales the mixed update.
    out = reference_merge("ties", base, [a, b], params, normalize=False, lam=0.5)["v"]
    assert out.tolist() == [9.0, 11.0, 13.5, 10.5]


def test_ties_keeps_all_ties_at_threshold_and_density_zero_drops_all(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [0.0, 0.0, 0.0, 0.0])
    a = _one_d(tmp_path, "a", [2.0, -2.0, 2.0, 1.0])
    # k = int(0.5 * 4) = 2, τ = 2, all three entries with |Δ| = 2 survive.
    out = reference_merge("ties", base, [a], [{"weight": 1.0, "density": 0.5}], normalize=False)["v"]
    assert out.tolist() == [2.0, -2.0, 2.0, 0.0]
    # k = int(0.2 * 4) = 0 -> τ = inf, nothing survives.
    out = reference_merge("ties", base, [a], [{"weight": 1.0, "density": 0.2}], normalize=False)["v"]
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_ties_zero_update_is_never_kept(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [1.0, 1.0])
    a = _one_d(tmp_path, "a", [1.0, 3.0])  # Δ_a = [0, 2]
    b = _one_d(tmp_path, "b", [1.0, 5.0])  # Δ_b = [0, 4]
    # Entry 0: all D are zero -> div 0 -> 1, mixed 0. Entry 1: (2 + 4) / (1 + 1) = 3.
    out = reference_merge("ties", base, [a, b], [{"weight": 1.0}, {"weight": 1.0}])["v"]
    assert out.tolist() == [1.0, 4.0]


# --------------------------------------------------------------------------------------------------
# DARE
# --------------------------------------------------------------------------------------------------


def test_dare_density_one_is_task_arithmetic_and_ties(three_models) -> None:
    base, a, b = three_models
    params = [{"weight": 0.6, "density": 1.0}, {"weight": 0.8}]
    keys = ["aa" * 16, "bb" * 16]
    assert_bytes_equal(
        reference_merge("dare_linear", base, [a, b], params, expert_keys=keys, seed=7),
        reference_merge("task_arithmetic", base, [a, b], params),
    )
    assert_bytes_equal(
        reference_merge("dare_ties", base, [a, b], params, expert_keys=keys, seed=7),
        reference_merge("ties", base, [a, b], params, normalize=False),
    )


def _mask_probe(tmp_path: Path, tag: str, shapes: dict[str, tuple[int, ...]], dtype=torch.float32):
    """Base zeros, expert ones, so dare_linear(w=1, d=0.5) outputs 2 where kept and 0 where dropped."""
    zeros = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}
    ones = {n: torch.ones(s, dtype=dtype) for n, s in shapes.items()}
    base = _save(tmp_path / f"{tag}_base.safetensors", zeros)
    one = _save(tmp_path / f"{tag}_one.safetensors", ones)
    return base, one


def _masks(base, experts, keys, seed=0, block_bytes=1 << 20, density=0.5) -> list[dict[str, torch.Tensor]]:
    """The keep mask of each expert, read off single-expert dare_linear merges."""
    out = []
    for expert, key in zip(experts, keys, strict=True):
        merged = reference_merge(
            "dare_linear",
            base,
            [expert],
            [{"weight": 1.0, "density": density}],
            expert_keys=[key],
            seed=seed,
            block_bytes=block_bytes,
            out_dtype=torch.float32,
            rescale="classic",
        )
        for t in merged.values():
            assert set(t.unique().tolist()) <= {0.0, 1.0 / density}
        out.append({n: t != 0 for n, t in merged.items()})
    return out


def test_dare_mask_matches_spec_formula(tmp_path: Path) -> None:
    shapes = {"w": (10, 4), "b": (7,), "s": ()}
    base, one = _mask_probe(tmp_path, "f", shapes)
    block_bytes = 48  # f32 rows of 16 bytes -> 3 rows per block -> blocks [0,3) [3,6) [6,9) [9,10)
    (mask,) = _masks(base, [one], ["cafe"], seed=5, block_bytes=block_bytes)

    def spec_block(index: int, shape: tuple[int, ...], name: str) -> torch.Tensor:
        key = hashlib.sha256(f"5\x1fcafe\x1f{name}\x1f{index}".encode()).digest()
        g = torch.Generator(device="cpu")
        g.manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
        return torch.rand(shape, generator=g, dtype=torch.float32) < 0.5

    block_rows = [3, 3, 3, 1]
    expected_w = torch.cat([spec_block(i, (rows, 4), "w") for i, rows in enumerate(block_rows)])
    assert torch.equal(mask["w"], expected_w)
    assert torch.equal(mask["b"], spec_block(0, (7,), "b"))
    assert torch.equal(mask["s"], spec_block(0, (), "s"))
    # Sanity: masks are neither empty nor full at density 0.5.
    assert 0 < int(mask["w"].sum()) < 40


def test_row_blocks() -> None:
    assert row_blocks((), 4, 16) == [(0, 1)]
    assert row_blocks((1000,), 4, 16) == [(0, 1000)]
    assert row_blocks((10, 4), 4, 48) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert row_blocks((10, 4), 2, 48) == [(0, 6), (6, 10)]
    assert row_blocks((3, 100), 4, 16) == [(0, 1), (1, 2), (2, 3)]  # rows wider than a block
    assert row_blocks((4, 2, 3), 4, 1 << 20) == [(0, 4)]


def test_dare_mask_blocks_follow_stored_itemsize() -> None:
    # Same shape, bf16 vs f32 storage: 2 rows per block vs 1 row per block at block_bytes = 32.
    m16 = dare_keep_mask(0, "k", "w", (4, 8), 2, 0.5, 32)
    m32 = dare_keep_mask(0, "k", "w", (4, 8), 4, 0.5, 32)
    # Block 0 of both starts from the same generator state, so row 0 agrees; row 1 of f32 is block 1.
    assert torch.equal(m16[0], m32[0])
    assert not torch.equal(m16[1], m32[1])
    assert torch.equal(m32[1], torch.rand(8, generator=_gen(0, "k", "w", 1)) < 0.5)
    assert torch.equal(m16[2:4], torch.rand((2, 8), generator=_gen(0, "k", "w", 1)) < 0.5)


def _gen(seed: int, key: str, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}\x1f{key}\x1f{name}\x1f{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def test_dare_mask_depends_only_on_seed_key_tensor_block(tmp_path: Path) -> None:
    shapes = {"w": (12, 4), "v": (12, 4)}
    base, one = _mask_probe(tmp_path, "p", shapes)
    base_long, one_long = _mask_probe(tmp_path, "q", {"w": (20, 4), "v": (12, 4)})
    bb = 64  # 4 rows per block

    ref = _masks(base, [one], ["k1"], seed=3, block_bytes=bb)[0]
    # Same (seed, key, tensor, block) -> same mask, whatever else is in the merge.
    assert torch.equal(_masks(base, [one], ["k1"], seed=3, block_bytes=bb)[0]["w"], ref["w"])
    two = reference_merge(
        "dare_linear",
        base,
        [one, one],
        [{"weight": 1.0, "density": 0.5}, {"weight": 0.0, "density": 0.5}],
        expert_keys=["k1", "k2"],
        seed=3,
        block_bytes=bb,
    )
    assert torch.equal(two["w"] != 0, ref["w"])
    # A longer tensor of the same name shares the masks of the blocks they have in common.
    longer = _masks(base_long, [one_long], ["k1"], seed=3, block_bytes=bb)[0]
    assert torch.equal(longer["w"][:12], ref["w"])
    # Changing any of seed, key, tensor name or block changes the mask.
    assert not torch.equal(_masks(base, [one], ["k1"], seed=4, block_bytes=bb)[0]["w"], ref["w"])
    assert not torch.equal(_masks(base, [one], ["k2"], seed=3, block_bytes=bb)[0]["w"], ref["w"])
    assert not torch.equal(ref["v"], ref["w"])  # same content, different tensor name
    assert not torch.equal(ref["w"][0:4], ref["w"][4:8])  # different block index


def test_dare_rescale(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [0.0] * 64)
    a = _one_d(tmp_path, "a", [3.0] * 64)
    out = reference_merge("dare_linear", base, [a], [{"weight": 1.0, "density": 0.25}], expert_keys=["x"],
                          rescale="classic")["v"]
    assert set(out.unique().tolist()) <= {0.0, 12.0}
    # MergeKit's rescale: true (the default): the kept values scaled so the L1 norm is the task vector's
    l1 = reference_merge("dare_linear", base, [a], [{"weight": 1.0, "density": 0.25}], expert_keys=["x"])["v"]
    kept = int((l1 != 0).sum())
    assert torch.equal(l1 != 0, out != 0) and 0 < kept < 64
    assert set(l1.unique().tolist()) == {0.0, float(torch.tensor(3.0) * (192.0 / (3.0 * kept)))}
    none = reference_merge("dare_linear", base, [a], [{"weight": 1.0, "density": 0.25}], expert_keys=["x"],
                           rescale="none")["v"]
    assert set(none.unique().tolist()) == {0.0, 3.0}
    with pytest.raises(ValueError, match="expert key"):
        reference_merge("dare_linear", base, [a], [{"weight": 1.0, "density": 0.25}])


# --------------------------------------------------------------------------------------------------
# Breadcrumbs
# --------------------------------------------------------------------------------------------------


def test_breadcrumbs_by_hand(tmp_path: Path) -> None:
    values = [1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0, 9.0, -10.0]
    base = _one_d(tmp_path, "base", [0.0] * 10)
    a = _one_d(tmp_path, "a", values)
    # target 5, n_top 1, n_bot 4: hi = 10, lo = 4 -> keep |Δ| in (4, 10).
    out = reference_merge("breadcrumbs", base, [a], [{"weight": 1.0, "density": 0.5, "gamma": 0.1}])["v"]
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, -6.0, 7.0, -8.0, 9.0, 0.0]
    # target 9, n_top 2, n_bot -1 -> n_top 1, n_bot 0: drop only the largest.
    out = reference_merge("breadcrumbs", base, [a], [{"weight": 1.0, "density": 0.95, "gamma": 0.2}])["v"]
    assert out.tolist() == values[:9] + [0.0]
    # Default gamma 0.01 -> n_top 0 on 10 elements: keep the top `target`.
    out = reference_merge("breadcrumbs", base, [a], [{"weight": 2.0, "density": 0.3}])["v"]
    assert out.tolist() == [0.0] * 7 + [-16.0, 18.0, -20.0]
    # density 1 -> task arithmetic.
    out = reference_merge("breadcrumbs", base, [a], [{"weight": 1.0, "density": 1.0, "gamma": 0.5}])["v"]
    assert out.tolist() == values


# --------------------------------------------------------------------------------------------------
# SLERP
# --------------------------------------------------------------------------------------------------


def test_slerp_endpoints(three_models) -> None:
    base, a, _ = three_models
    assert_bytes_equal(reference_merge("slerp", base, [a], [], t=0.0), load_model(base))
    assert_bytes_equal(reference_merge("slerp", base, [a], [], t=1.0), load_model(a))


def test_slerp_orthogonal_and_parallel(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [1.0, 0.0])
    other = _one_d(tmp_path, "other", [0.0, 1.0])
    out = reference_merge("slerp", base, [other], [], t=0.5)["v"]
    assert torch.allclose(out, torch.tensor([math.sqrt(0.5), math.sqrt(0.5)]), rtol=0, atol=1e-7)
    # Parallel vectors fall back to lerp.
    scaled = _one_d(tmp_path, "scaled", [3.0, 0.0])
    out = reference_merge("slerp", base, [scaled], [], t=0.25)["v"]
    assert out.tolist() == [1.5, 0.0]
    with pytest.raises(ValueError):
        reference_merge("slerp", base, [other, scaled], [], t=0.5)


def test_dare_ties_by_hand(tmp_path: Path) -> None:
    base = _one_d(tmp_path, "base", [0.0] * 32)
    a = _one_d(tmp_path, "a", [2.0] * 32)  # Δ_a = 2, density 0.5 -> T_a = 4 where kept, else 0
    b = _one_d(tmp_path, "b", [-1.0] * 32)  # Δ_b = -1, density 1
    params = [{"weight": 1.0, "density": 0.5}, {"weight": 1.0}]
    out = reference_merge("dare_ties", base, [a, b], params, expert_keys=["ka", "kb"], seed=11)["v"]
    keep_a = torch.rand(32, generator=_gen(11, "ka", "v", 0)) < 0.5
    # Kept: S = 3 -> only a agrees -> 4. Dropped: S = -1 -> only b agrees -> -1.
    assert torch.equal(out, torch.where(keep_a, 4.0, -1.0))
    assert 0 < int(keep_a.sum()) < 32


# --------------------------------------------------------------------------------------------------
# The partial-budget oracle: omitted rows, compared rows
# --------------------------------------------------------------------------------------------------


def test_selected_rows_zero_the_omitted_deltas(three_models) -> None:
    """`selected_rows`: every row read is the plain merge; nothing read is θ₀ (task arithmetic: θ₀ + 0);
    some rows read give the plain merge on those rows and θ₀ elsewhere, for θ-sources and Δ-sources alike."""
    base, a, b = three_models
    params = [{"weight": 0.7}, {"weight": -0.4}]
    plain = reference_merge("task_arithmetic", base, [a, b], params)
    everything = {name: [(0, max(1, t.shape[0] if t.dim() else 1))] for name, t in load_model(base).items()}
    assert_bytes_equal(reference_merge("task_arithmetic", base, [a, b], params,
                                       selected_rows=[everything, everything]), plain)
    theta0 = load_model(base)
    assert_bytes_equal(reference_merge("task_arithmetic", base, [a, b], params, selected_rows=[{}, {}]),
                       {n: (t.float() + 0.0).to(t.dtype) for n, t in theta0.items()})
    some = {"embed.weight": [(2, 5), (9, 10)]}
    got = reference_merge("task_arithmetic", base, [a, b], params, selected_rows=[some, some])
    rows = torch.zeros(16, dtype=torch.bool)
    rows[2:5] = rows[9:10] = True
    assert torch.equal(got["embed.weight"][rows], plain["embed.weight"][rows])
    assert torch.equal(got["embed.weight"][~rows], theta0["embed.weight"][~rows])
    deltas = [{n: t.float() - theta0[n].float() for n, t in load_model(p).items()} for p in (a, b)]
    by_delta = reference_merge("task_arithmetic", base, [base, base], params, expert_deltas=deltas,
                               selected_rows=[some, some])
    assert_bytes_equal(by_delta, got)


def test_ignore_rows_leave_out_only_those_rows() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    y = x.clone()
    y[1, 2] = -1.0
    assert_bytes_equal({"t": x}, {"t": y}, ignore_rows={"t": [(1, 2)]})
    with pytest.raises(AssertionError, match="1 of 12 elements differ"):
        assert_bytes_equal({"t": x}, {"t": y}, ignore_rows={"t": [(2, 4)]})
    s = torch.tensor(1.0)
    assert_bytes_equal({"s": s}, {"s": torch.tensor(2.0)}, ignore_rows={"s": [(0, 1)]})
