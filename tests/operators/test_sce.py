"""sce under a partial selection: the formula on the rows read only (docs/SEMANTICS.md, sce).

The reference below is plain torch written from SEMANTICS.md: it compacts the rows some expert selected itself
(from the block layout), runs var/topk/sign/sum on them, divides Σ tvs_k² by the whole tensor's numel, and
writes θ₀ + 0.0 (the formula's value for an all-zero Δ) on every other row. Compared as int32 bit patterns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import f32_bits, fold_deltas, fold_stored, stored_with_garbage, tile_cases

from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

SHAPE, RPB = (40, 24), 4  # 10 blocks of 4 rows


def lit_sce(b: torch.Tensor, tvs: torch.Tensor, topk: float, divisor: int) -> torch.Tensor:
    """sce on θ₀ `b` (M,) and the stacked Δ `tvs` (K, M); w_k = Σ tvs_k² / divisor."""
    if topk < 1:
        mask = torch.zeros(tvs.shape[1:], dtype=torch.float32)
        if topk > 0:
            var = torch.var(tvs, dim=0, unbiased=False)
            k = int(int((var != 0).sum()) * topk)
            if k:
                mask[torch.topk(var.abs(), k).indices] = 1
        tvs = tvs * mask
    majority = (tvs.sum(dim=0) >= 0).float() * 2 - 1
    erase = tvs.sign() == majority
    w = (tvs * tvs).sum(dim=1) / divisor
    total = float(w.sum())
    w = torch.full_like(w, 1 / len(w)) if abs(total) < 1e-6 else w / total
    erased = w[:, None] * erase
    return b + (tvs * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)


def _blocks_rows(blocks) -> list[int]:
    return sorted({r for b in blocks for r in range(b * RPB, min(SHAPE[0], (b + 1) * RPB))})


def _case(seed: int, big: float | None = None):
    g = np.random.default_rng(seed)
    base = g.standard_normal(SHAPE).astype(np.float32)
    base[[1, 9, 14, 20], 3] = -0.0  # rows 1, 14 are read below, 9, 20 are not
    selected = [(0, 1, 3, 7), (0, 1, 7), (), (1, 3, 7)]  # expert 1's block 3 and expert 2 hold Δ = 0
    deltas = []
    for blocks in selected:
        d = np.zeros(SHAPE, np.float32)
        for r in _blocks_rows(blocks):
            d[r] = (g.standard_normal(SHAPE[1]) * 0.01).astype(np.float32)
            d[r, g.integers(0, SHAPE[1], 3)] = 0.0
        deltas.append(d)
    deltas[0][2, 2] = -deltas[3][2, 2]  # a cancelling pair
    if big is not None:
        deltas[0][4, 0] = big
    return base, selected, deltas


def _run(base, selected, deltas, topk, full):
    return fold_deltas("sce", base, selected, deltas, {"select_topk": topk}, full=full, rows_per_block=RPB)


@pytest.mark.parametrize("topk", [0.5, 0.0, 1.0, 0.1])
def test_partial_selection_is_the_formula_on_the_rows_read(topk) -> None:
    base, selected, deltas = _case(3)
    got = _run(base, selected, deltas, topk, full=False)
    rows = _blocks_rows({b for s in selected for b in s})
    b = torch.from_numpy(base)
    tvs = torch.stack([torch.from_numpy(d) for d in deltas])
    want = b + 0.0
    want[rows] = lit_sce(b[rows].flatten(), tvs[:, rows].reshape(len(deltas), -1), topk, base.size).reshape(-1, 24)
    assert np.array_equal(f32_bits(got), f32_bits(want))
    # the omitted rows are the whole-tensor formula's (today's) bytes: θ₀ + 0.0, -0.0 there becomes +0.0
    whole = lit_sce(b.flatten(), tvs.reshape(len(deltas), -1), topk, base.size).reshape(SHAPE)
    omitted = [r for r in range(SHAPE[0]) if r not in rows]
    assert np.array_equal(f32_bits(got[omitted]), f32_bits(whole[omitted]))
    assert f32_bits(got[9, 3]) == 0 and f32_bits(got[20, 3]) == 0
    assert np.allclose(got, whole.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("topk", [0.5, 1.0])
def test_full_selection_is_the_whole_tensor_formula(topk) -> None:
    """Every expert `full` (its unread blocks hold Δ = 0): the whole tensor, torch's mean, as MergeKit."""
    base, selected, deltas = _case(4)
    got = _run(base, selected, deltas, topk, full=True)
    tvs = torch.stack([torch.from_numpy(d) for d in deltas]).reshape(len(deltas), -1)
    want = lit_sce(torch.from_numpy(base).flatten(), tvs, topk, base.size).reshape(SHAPE)
    assert np.array_equal(f32_bits(got), f32_bits(want))


def test_omitted_rows_follow_the_formula_when_the_weights_overflow() -> None:
    """A Δ of 1e20 squares to inf: the whole-tensor formula gives NaN on the omitted rows; so does the
    compacted one (the omitted rows take the formula's value for Δ = 0 with the same weights)."""
    base, selected, deltas = _case(5, big=1e20)
    got = _run(base, selected, deltas, 0.5, full=False)
    tvs = torch.stack([torch.from_numpy(d) for d in deltas]).reshape(len(deltas), -1)
    whole = lit_sce(torch.from_numpy(base).flatten(), tvs, 0.5, base.size).reshape(SHAPE).numpy()
    assert np.isnan(whole[9]).all()
    assert np.array_equal(np.isnan(got), np.isnan(whole))


def test_no_row_read_gives_the_base_plus_zero() -> None:
    base, selected, deltas = _case(6)
    got = _run(base, [(), (), (), ()], deltas, 0.5, full=False)
    assert np.array_equal(f32_bits(got), f32_bits(base + np.float32(0.0)))


# -- the kernels' formula (numba) against torch's on arrays past the torch-computed last columns ---------------


def _op(topk: float, n_experts: int):
    return make_operator("sce", [ExpertParams(f"e{k}") for k in range(n_experts)], options={"select_topk": topk})


def _deltas(seed: int, n_experts: int, n: int) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    ds = []
    for _ in range(n_experts):
        d = (g.standard_normal(n) * 10.0 ** g.integers(-4, 1, n)).astype(np.float32)
        d[g.integers(0, n, n // 10)] = 0.0
        d[g.integers(0, n, 20)] = -0.0
        ds.append(d)
    ds[1][::7] = -ds[0][::7]  # cancelling pairs
    return ds


@pytest.mark.parametrize("n", [5000, 70_001])  # sorted / radix-selected threshold
@pytest.mark.parametrize("topk", [0.5, 0.1, 0.999])
def test_selection_is_torch_topk_without_ties(n, topk) -> None:
    ds = _deltas(n, 6, n)
    var = torch.var(torch.stack([torch.from_numpy(d) for d in ds]), dim=0, unbiased=False)
    k = int(int(torch.count_nonzero(var)) * topk)
    want = np.zeros(n, np.uint8)
    want[torch.topk(var.abs(), k).indices.numpy()] = 1
    cut = var.abs().numpy()[want == 1].min()
    assert int((var.abs().numpy() == cut).sum()) == 1  # no tie at the cut: torch's choice is then unique
    got = _op(topk, len(ds))._keep(ds)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n", [3000, 50_000])
@pytest.mark.parametrize("n_tied", [150, 400, 1])  # tied values kept: some, all, one
def test_selection_with_ties_at_the_cut_is_torch_topk(n, n_tied) -> None:
    """Variances equal to the k-th largest: all of them kept when the cut falls at their end (no torch.topk),
    torch.topk's own choice among them when it falls inside."""
    g = np.random.default_rng(n)
    a = (g.standard_normal(n) * 0.01).astype(np.float32)
    tied = np.sort(g.choice(n, 400, replace=False))
    a[tied] = 0.005  # Δ = ±a over two experts: var = a² exactly, the same for these
    ds = [a, -a]
    var = torch.var(torch.stack([torch.from_numpy(d) for d in ds]), dim=0, unbiased=False)
    t = var[tied[0]]
    k = int((var > t).sum()) + n_tied
    topk = (k + 0.5) / int(torch.count_nonzero(var))
    assert int(int(torch.count_nonzero(var)) * topk) == k
    want = np.zeros(n, np.uint8)
    want[torch.topk(var.abs(), k).indices.numpy()] = 1
    got = _op(topk, 2)._keep(ds)
    assert int(got.sum()) == k and np.array_equal(got, want)


@pytest.mark.parametrize("data", ["near", "grid"])
def test_abs_var_is_torch_var_bit_for_bit(data) -> None:
    """Where float64 rounding shows through the float32 result: near-equal values (a two-pass variance differs
    from torch's Welford there) and values on a grid (so does a Welford dividing by multiplying by 1/n)."""
    from mergepipe_db.kernels import merge as kern

    g = np.random.default_rng(11)
    n = 300_001  # three chunks of the threaded kernel
    if data == "near":
        c = g.standard_normal(n).astype(np.float32)
        ds = [(c * (1 + g.standard_normal(n) * 10.0 ** g.integers(-7, 0, n))).astype(np.float32) for _ in range(8)]
    else:
        ds = [g.integers(-1000, 1000, n).astype(np.float32) * np.float32(2**-20) for _ in range(8)]
    ds[2][::97] = np.inf
    ds[3][::89] = np.nan
    ds[4][::5] = ds[5][::5]
    want = torch.var(torch.stack([torch.from_numpy(d) for d in ds]), dim=0, unbiased=False).abs().numpy()
    got = np.empty(n, np.float32)
    nonzero = kern.sce_abs_var(got, kern.pack(ds), len(ds))
    assert np.array_equal(f32_bits(got), f32_bits(want))
    assert nonzero == int(np.count_nonzero(want))


@pytest.mark.parametrize("n_experts", [3, 8])
@pytest.mark.parametrize("topk", [0.5, 1.0, 0.0])
@pytest.mark.parametrize("shape", [(300, 1037), (64 * 100 + 37,), (700, 1037)])  # 2, 1 and 5 threaded chunks
def test_whole_tensor_is_the_torch_formula_bit_for_bit(shape, topk, n_experts) -> None:
    _whole_tensor_is_the_formula(shape, topk, n_experts)


def test_long_rows_summed_on_one_thread_workers_are_the_formula() -> None:
    """A tensor of a million elements (where torch would split one row's sum across threads): its sums of
    squares run on the one-thread torch pool beside the next expert's squares, two buffers in turn (three
    experts: the first is waited for, then reused); torch summing the stacked array on its own threads gives the
    same bits."""
    _whole_tensor_is_the_formula((1030, 1024), 0.5, 3)


def _whole_tensor_is_the_formula(shape: tuple[int, ...], topk: float, n_experts: int) -> None:
    n = int(np.prod(shape))
    ds = [d.reshape(shape) for d in _deltas(n + n_experts, n_experts, n)]
    base = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    base.flat[::101] = -0.0
    ctx = TensorContext(name="w", shape=shape, rows_per_block=shape[0], n_blocks=1, seed=0)
    op = _op(topk, n_experts)
    op.begin(base, ctx)
    for k, d in enumerate(ds):
        op.add(ExpertInput.from_delta(k, None, (0,), True, delta=d))
    got = op.finish()
    tvs = torch.stack([torch.from_numpy(d).reshape(-1) for d in ds])
    want = lit_sce(torch.from_numpy(base).reshape(-1), tvs, topk, n).reshape(shape)
    assert np.array_equal(f32_bits(got), f32_bits(want))


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("topk", [0.5, 1.0, 0.1, 0.01])  # 0.01: k·64 <= numel, torch's heap select, not reproduced
def test_stored_values_held_give_the_formula(topk, dtype, monkeypatch) -> None:
    """Inputs read in place (θ_k's stored values, garbage — NaN, inf — on the rows not read) are held and Δ_k
    formed from them in the variance, the squares and the sum (`_combine_raw`): the formula's bytes on the Δ_k
    (0 on unread rows), the array's last columns by torch included; an expert with nothing selected too."""
    from mergepipe_db.kernels import merge as mk

    calls = []
    raw_combine = mk.sce_combine_raw
    monkeypatch.setattr(mk, "sce_combine_raw", lambda *a: (calls.append(1), raw_combine(*a))[1])
    base, selected, deltas = _case(6)
    base, stored, want_d = stored_with_garbage(base, deltas, selected, RPB, dtype, 7)
    got = fold_stored("sce", base, selected, stored, {"select_topk": topk}, full=True, rows_per_block=RPB)
    assert calls == [1]
    tvs = torch.stack([torch.from_numpy(d) for d in want_d]).reshape(len(want_d), -1)
    want = lit_sce(torch.from_numpy(base).flatten(), tvs, topk, base.size).reshape(SHAPE)
    assert np.array_equal(f32_bits(got), f32_bits(want))


@pytest.mark.parametrize("topk", [0.5, 1.0])
def test_stored_values_tiles_read_whole_in_part_or_not_at_all(topk) -> None:
    """Blocks of 2,048 elements (two tiles of `RAW_TILE`) and of 24 (many to a tile), some tiles read by no
    expert, the first expert reading nothing, the array's last columns in a tile read in part: the formula's bytes."""
    for shape, rpb, selected, base, deltas in tile_cases(23):
        base, stored, deltas = stored_with_garbage(base, deltas, selected, rpb, "bf16", 24)
        got = fold_stored("sce", base, selected, stored, {"select_topk": topk}, full=True, rows_per_block=rpb)
        tvs = torch.stack([torch.from_numpy(d) for d in deltas]).reshape(len(deltas), -1)
        want = lit_sce(torch.from_numpy(base).flatten(), tvs, topk, base.size).reshape(shape)
        assert np.array_equal(f32_bits(got), f32_bits(want))


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("topk", [0.5, 0.1])
def test_stored_values_held_under_a_partial_selection_are_gathered_on_the_rows_read(topk, dtype,
                                                                                   monkeypatch) -> None:
    """Inputs read in place (garbage on the rows not read) under a partial selection: gathered straight into the
    compacted rows (never a whole tensor's float32 copy), the bytes of the compacted formula on their Δ_k; an
    expert with nothing selected gives Δ_k = 0 there. Blocks of 4 rows, and of 2,048 and 24 elements (tiles
    read in part)."""
    from mergepipe_db.kernels import gather as gk

    sizes = []
    gather = gk.gather_delta
    monkeypatch.setattr(gk, "gather_delta", lambda out, *a: (sizes.append(out.size), gather(out, *a))[1])
    base, selected, deltas = _case(8)
    cases = [(SHAPE, RPB, selected, base, deltas), *tile_cases(31)]
    for shape, rpb, sel, b, ds in cases:
        b, stored, want_d = stored_with_garbage(b, ds, sel, rpb, dtype, 9)
        sizes.clear()
        got = fold_stored("sce", b, sel, stored, {"select_topk": topk}, full=False, rows_per_block=rpb)
        rows = sorted({r for s in sel for blk in s for r in range(blk * rpb, min(shape[0], (blk + 1) * rpb))})
        bt, tvs = torch.from_numpy(b), torch.stack([torch.from_numpy(d) for d in want_d])
        want = bt + 0.0
        want[rows] = lit_sce(bt[rows].flatten(), tvs[:, rows].reshape(len(want_d), -1), topk,
                             b.size).reshape(len(rows), *shape[1:])
        assert np.array_equal(f32_bits(got), f32_bits(want))
        if len(rows) < shape[0]:  # compacted: each held input gathered on the rows read only
            row = b.size // shape[0]
            assert sizes and all(n == len(rows) * row for n in sizes), (sizes, len(rows) * row)
