"""ram and ramplus_tl under a partial selection: the formula on the rows read only (docs/SEMANTICS.md, ram).

The reference is the whole-tensor formula in plain numpy, written from SEMANTICS.md, run on every row (Δ_k = 0
on the rows no expert read): the compacted computation must give the same bytes everywhere (compared as int32
bit patterns), -0.0 in θ₀ included, for ε > 0, an |Δ| exactly at ε, ε = 0 and ε < 0 (where |0| > ε counts the
omitted rows for every expert in ramplus_tl's ratios; ramplus_tl with ε < 0 is taken with one expert only:
with K > 1 every element then overlaps, unique_k = 0 and ρ_k = shared_k / max(0, ε) divides by zero, as before).
"""

from __future__ import annotations

import numpy as np
import pytest
from builders import f32_bits, fold_deltas, fold_stored, stored_with_garbage, tile_cases

from mergepipe_db.operators.ram import RamFold

SHAPE, RPB = (40, 24), 4  # 10 blocks of 4 rows
SELECTED = [(0, 1, 3, 7), (0, 1, 7), (), (1, 3, 7)]  # expert 2 selects nothing; blocks 2, 4, 5, 6, 8, 9 unread


def plain(base, deltas, eps, r=None, alpha=None):
    """out = θ₀ + Σ_k (z_k·unique·λ_k + (z_k·overlap) / float32(max(c, 1))), summed in order into +0.0."""
    nz = [np.abs(d) > eps for d in deltas]
    c = np.sum(np.stack(nz).astype(np.int64), axis=0)
    unique, overlap = c == 1, c > 1
    acc = np.zeros(base.shape, np.float32)
    for d, m in zip(deltas, nz):
        lam = 1.0
        if r is not None:
            rho = int((m & overlap).sum()) / max(float(int((m & unique).sum())), eps)
            lam = 1.0 + r * min(max(rho, 0.0), alpha)
        z = np.where(m, d, np.float32(0.0))
        a = np.where(unique, z * np.float32(lam), np.float32(0.0))
        b = np.where(overlap, z / np.maximum(c, 1).astype(np.float32), np.float32(0.0))
        acc = acc + (a + b)
    return base + acc


def _rows(blocks) -> list[int]:
    return sorted({r for b in blocks for r in range(b * RPB, min(SHAPE[0], (b + 1) * RPB))})


def _case(seed: int, eps: float, selected=SELECTED):
    g = np.random.default_rng(seed)
    base = g.standard_normal(SHAPE).astype(np.float32)
    base[[1, 9, 14, 20], 3] = -0.0  # rows 1, 14 are read, 9, 20 are not
    deltas = []
    for blocks in selected:
        d = np.zeros(SHAPE, np.float32)
        for r in _rows(blocks):
            d[r] = (g.standard_normal(SHAPE[1]) * 0.01).astype(np.float32)
            d[r, g.integers(0, SHAPE[1], 6)] = 0.0  # unique updates and untouched elements
            d[r, g.integers(0, SHAPE[1], 2)] = np.float32(abs(eps)) * g.choice([-1, 1])  # |Δ| == |ε|
            d[r, g.integers(0, SHAPE[1], 1)] = -0.0
        deltas.append(d)
    return base, deltas


def _run(method, base, selected, deltas, opts, full):
    return fold_deltas(method, base, selected, deltas, opts, full=full, rows_per_block=RPB)


CASES = [("ram", {"epsilon": 1e-3}), ("ram", {"epsilon": 0.0}), ("ram", {"epsilon": -1e-3}),
         ("ramplus_tl", {"epsilon": 1e-3, "r": 0.3, "alpha": 5.0}),
         ("ramplus_tl", {"epsilon": 1e-5, "r": -0.7, "alpha": 0.2})]


def _want(method, opts, base, deltas):
    eps = opts["epsilon"]
    if method == "ram":
        return plain(base, deltas, eps)
    return plain(base, deltas, eps, opts["r"], opts["alpha"])


@pytest.mark.parametrize("method,opts", CASES)
def test_partial_selection_gives_the_whole_tensor_bytes(method, opts, monkeypatch) -> None:
    base, deltas = _case(3, opts["epsilon"])
    sizes = []
    formula = RamFold._formula

    def spy(self, b, values, omitted, raws=None):
        sizes.append(b.size)
        return formula(self, b, values, omitted, raws)

    monkeypatch.setattr(RamFold, "_formula", spy)
    got = _run(method, base, SELECTED, deltas, opts, full=False)
    read = _rows({b for s in SELECTED for b in s})
    assert sizes == [len(read) * SHAPE[1]]  # the formula ran on the rows read only
    want = _want(method, opts, base, deltas)
    assert np.array_equal(f32_bits(got), f32_bits(want))
    assert f32_bits(got[9, 3]) == 0 and f32_bits(got[20, 3]) == 0  # -0.0 + 0.0 on an omitted row
    # the full selection (today's whole-tensor path) gives the same bytes
    sizes.clear()
    full = _run(method, base, SELECTED, deltas, opts, full=True)
    assert sizes == [base.size]
    assert np.array_equal(f32_bits(full), f32_bits(got))


def test_one_expert_partial_selection_matches_the_whole_tensor() -> None:
    selected = [(0, 2)]
    base, deltas = _case(7, 1e-3, selected)
    opts = {"epsilon": 1e-3, "r": 0.5, "alpha": 10.0}
    got = _run("ramplus_tl", base, selected, deltas, opts, full=False)
    assert np.array_equal(f32_bits(got), f32_bits(_want("ramplus_tl", opts, base, deltas)))


@pytest.mark.parametrize("eps", [0.0, -1e-3])
def test_ramplus_tl_refuses_an_epsilon_that_rho_could_divide_by(eps) -> None:
    """ρ_k = shared_k / max(unique_k, ε): with ε <= 0 an expert without a unique update divides by zero (MergeKit
    makes that tensor NaN); refused with a named error before anything is read."""
    from mergepipe_db.errors import MethodParameterError

    base, deltas = _case(7, eps, [(0, 2)])
    with pytest.raises(MethodParameterError, match="epsilon must be > 0"):
        _run("ramplus_tl", base, [(0, 2)], deltas, {"epsilon": eps, "r": 0.5, "alpha": 10.0}, full=False)


@pytest.mark.parametrize("method,opts", [CASES[0], CASES[3]])
def test_no_row_read_gives_the_base_plus_zero(method, opts) -> None:
    base, deltas = _case(6, opts["epsilon"])
    none = [(), (), (), ()]
    got = _run(method, base, none, [np.zeros(SHAPE, np.float32)] * 4, opts, full=False)
    assert np.array_equal(f32_bits(got), f32_bits(base + np.float32(0.0)))


def _raw_formula_calls(monkeypatch) -> list[int]:
    """A list that gets a 1 each time the formula runs on the stored values (ram's `ram_combine_raw`, ramplus_tl's
    `ramplus_raw`)."""
    from mergepipe_db.kernels import gather as gk

    calls: list[int] = []
    for name in ("ram_combine_raw", "ramplus_raw"):
        kernel = getattr(gk, name)
        monkeypatch.setattr(gk, name, lambda *a, _k=kernel: (calls.append(1), _k(*a))[1])
    return calls


def _stored_case(seed: int, eps: float, selected, dtype: str):
    base, deltas = _case(seed, eps, selected)
    return stored_with_garbage(base, deltas, selected, RPB, dtype, seed + 100)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("method,opts", CASES)
def test_stored_values_held_give_the_gathered_bytes(method, opts, dtype, monkeypatch) -> None:
    """Inputs read in place are held and the formula forms Δ_k from them (`_combine_raw`), their unread rows
    made θ₀'s: the same bytes as the formula on the gathered Δ_k, at full selection (an expert with nothing
    selected included) and under a partial one (a tile no expert read gives Δ_k = +0.0 there, as the compacted
    formula on gathered values does)."""
    calls = _raw_formula_calls(monkeypatch)
    selected = SELECTED if opts["epsilon"] >= 0 or method == "ram" else [(0, 2)]
    base, stored, deltas = _stored_case(11, opts["epsilon"], selected, dtype)
    want = _want(method, opts, base, deltas)
    got = fold_stored(method, base, selected, [s.copy() for s in stored], opts, full=True, rows_per_block=RPB)
    assert calls == [1]
    assert np.array_equal(f32_bits(got), f32_bits(want))
    got = fold_stored(method, base, selected, [s.copy() for s in stored], opts, full=False, rows_per_block=RPB)
    assert calls == [1, 1]  # held under a partial selection too: no float32 copy gathered and compacted
    assert np.array_equal(f32_bits(got), f32_bits(want))


@pytest.mark.parametrize("spoil", ["nan_base", "inexact_base", "mixed_dtypes"])
def test_stored_values_not_held_where_the_base_cannot_fill_them(spoil, monkeypatch) -> None:
    """Where an unread row cannot be made θ₀'s exactly (θ₀ NaN, inf or not a BF16 value there) or the experts'
    stored dtypes differ, the inputs are gathered: still the formula's bytes."""
    calls = _raw_formula_calls(monkeypatch)
    opts = CASES[3][1]
    base, stored, deltas = _stored_case(12, opts["epsilon"], SELECTED, "bf16")
    if spoil == "nan_base":
        base[9, 5] = np.nan  # row 9 is unread by every expert
    elif spoil == "inexact_base":
        base[20, 2] = np.float32(1.0 + 2.0**-20)
    else:
        stored[1] = (stored[1].astype(np.uint32) << 16).view(np.float32)
    want = _want("ramplus_tl", opts, base, deltas)
    got = fold_stored("ramplus_tl", base, SELECTED, stored, opts, full=True, rows_per_block=RPB)
    assert calls == []
    assert np.array_equal(f32_bits(got), f32_bits(want))


@pytest.mark.parametrize("method,opts", [CASES[0], CASES[3]])
def test_stored_values_tiles_read_whole_in_part_or_not_at_all(method, opts) -> None:
    """Blocks of 2,048 elements (two tiles of `RAW_TILE`) and of 24 (many to a tile): tiles no expert read are
    never touched (garbage stays there: Δ = +0.0), tiles read in part are completed from θ₀."""
    for _shape, rpb, selected, base, deltas in tile_cases(21):
        base, stored, deltas = stored_with_garbage(base, deltas, selected, rpb, "bf16", 22)
        got = fold_stored(method, base, selected, stored, opts, full=True, rows_per_block=rpb)
        assert np.array_equal(f32_bits(got), f32_bits(_want(method, opts, base, deltas)))


@pytest.mark.parametrize("method,opts", [CASES[0], CASES[2], CASES[3]])
def test_held_and_gathered_inputs_mixed_under_a_partial_selection(method, opts, monkeypatch) -> None:
    """One expert stored in another dtype is gathered at add, the others held in place; under a partial selection
    the float32 formula then runs on the rows read, the held inputs gathered there only: the formula's bytes."""
    calls = _raw_formula_calls(monkeypatch)
    selected = SELECTED if opts["epsilon"] >= 0 or method == "ram" else [(0, 2)]
    base, stored, deltas = _stored_case(13, opts["epsilon"], selected, "bf16")
    stored[1] = (stored[1].astype(np.uint32) << 16).view(np.float32)
    got = fold_stored(method, base, selected, stored, opts, full=False, rows_per_block=RPB)
    assert calls == []
    assert np.array_equal(f32_bits(got), f32_bits(_want(method, opts, base, deltas)))


def test_ramplus_tl_with_more_experts_than_a_byte_codes_takes_two_passes(monkeypatch) -> None:
    """ramplus_raw keeps the one updating expert's index in a byte (255: none); with 255 experts or more the
    counts and the formula run as two passes over the stored values (`ram_counts_raw`, `ram_combine_raw`): the
    same bytes. Shown with the limit lowered to 2 for three experts."""
    from mergepipe_db.kernels import gather as gk

    calls = []
    for name in ("ram_counts_raw", "ram_combine_raw", "ramplus_raw"):
        kernel = getattr(gk, name)
        monkeypatch.setattr(gk, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    monkeypatch.setattr(gk, "NOT_UNIQUE", 2)
    opts = CASES[3][1]
    selected = SELECTED[:3]
    base, stored, deltas = _stored_case(14, opts["epsilon"], selected, "bf16")
    got = fold_stored("ramplus_tl", base, selected, stored, opts, full=True, rows_per_block=RPB)
    assert calls == ["ram_counts_raw", "ram_combine_raw"]
    assert np.array_equal(f32_bits(got), f32_bits(_want("ramplus_tl", opts, base, deltas)))
