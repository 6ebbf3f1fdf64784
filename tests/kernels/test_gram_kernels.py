"""The geometric methods' passes (`kernels.gram`): the Gram matrix summed in the order its module states, checked
against that order written plainly in the reference merge; the same bits from stored values, from float32
vectors and at 1 or 2 threads; and the weighted sum equal, byte for byte, to the numpy formula it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_merge import ordered_dot
from test_threaded_kernels import threads

from mergepipe_db.kernels import gram as G
from mergepipe_db.kernels.gram import pass_inputs

SIZES = [1, 63, 2049, (1 << 17) + 5, 3 * (1 << 17) + 4321]


def family(n: int, k: int, seed: int, specials: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """θ₀ (float32) and k experts' stored values (BF16 patterns) near it, some elements unchanged."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    raws = []
    for _ in range(k):
        x32 = base + (rng.standard_normal(n) * 0.002).astype(np.float32)
        x = (x32.view(np.uint32) >> 16).astype(np.uint16)
        same = rng.random(n) < 0.3
        x[same] = (base[same].view(np.uint32) >> 16).astype(np.uint16)
        raws.append(x)
    if specials and n > 10:
        raws[0][5], raws[-1][9] = 0x7F80, 0xFF80  # +inf, -inf
    return base, raws


def widen(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def blocks(n: int) -> np.ndarray:
    """Element offsets of uneven blocks over [0, n)."""
    cuts = sorted({0, n, *(int(n * f) for f in (0.17, 0.5, 0.81))})
    return np.array(cuts, np.int64)


def deltas(base: np.ndarray, raws: list[np.ndarray], selected: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """Δ_k = widen(θ_k) − θ₀ (float32) on the selected blocks, 0 elsewhere: the vectors, formed plainly."""
    out = []
    for k, r in enumerate(raws):
        d = np.zeros_like(base)
        for b in range(len(bounds) - 1):
            s, e = bounds[b], bounds[b + 1]
            if selected[k, b]:
                d[s:e] = widen(r[s:e]) - base[s:e]
        out.append(d)
    return out


def stated_order_gram(vectors: list[np.ndarray]) -> np.ndarray:
    """The Gram matrix in the order docs/SEMANTICS.md states ("Inner products"), by the reference merge's
    plain loops (`reference_merge.ordered_dot`)."""
    m = len(vectors)
    t = [torch.from_numpy(v) for v in vectors]
    g = np.zeros((m, m))
    for i in range(m):
        for j in range(i, m):
            g[i, j] = g[j, i] = ordered_dot(t[i], t[j])
    return g


@pytest.mark.parametrize("n", SIZES)
def test_gram_is_the_stated_order_from_bytes_or_vectors_at_any_thread_count(n: int) -> None:
    base, raws = family(n, 3, n)
    bounds = blocks(n)
    selected = np.ones((3, len(bounds) - 1), np.bool_)
    selected[1, 0] = False  # expert 1's first block not read: Δ = 0 there, its bytes never touched
    raws[1][bounds[0]:bounds[1]] = 0x7FC0  # ... so a NaN planted there must not show
    ds = deltas(base, raws, selected, bounds)
    want = stated_order_gram([base, *ds])
    from_bytes = pass_inputs(raws, [], [G.FROM_DELTA] * 3, [0, 1, 2], selected)
    from_vecs = pass_inputs([], ds, [G.FROM_VEC] * 3, [0, 1, 2], selected[:1])
    mixed = pass_inputs([raws[0], raws[2]], [ds[1]], [G.FROM_DELTA, G.FROM_VEC, G.FROM_DELTA], [0, 0, 1],
                        selected[[0, 2]])
    for t in (1, 2):
        with threads(t):
            for inputs in (from_bytes, from_vecs, mixed):
                got = G.gram_pass(base, *inputs, bounds, True)
                assert got.tobytes() == want.tobytes()
                no_base = G.gram_pass(base, *inputs, bounds, False)
                assert not no_base[0].any() and not no_base[:, 0].any()
                assert no_base[1:, 1:].tobytes() == want[1:, 1:].tobytes()


def test_gram_of_thetas_and_float32_experts() -> None:
    """slerp's form: v = widen(θ_1) itself; and float32 stored values."""
    n = (1 << 17) + 99
    base, raws = family(n, 2, 7, specials=False)
    bounds = blocks(n)
    sel = np.ones((1, len(bounds) - 1), np.bool_)
    theta = widen(raws[0])
    want = stated_order_gram([base, theta])
    got = G.gram_pass(base, *pass_inputs([raws[0]], [], [G.FROM_THETA], [0], sel), bounds, True)
    assert got.tobytes() == want.tobytes()
    got32 = G.gram_pass(base, *pass_inputs([theta], [], [G.FROM_DELTA], [0], sel), bounds, True)
    assert got32.tobytes() == stated_order_gram([base, theta - base]).tobytes()


@pytest.mark.parametrize("n", [1, 2049, 3 * (1 << 17) + 4321])
@pytest.mark.parametrize("a0", [1.0, 0.75, -2.5])
def test_combine_is_the_numpy_formula_bit_for_bit(n: int, a0: float) -> None:
    base, raws = family(n, 3, n + 1, specials=True)
    if n > 10:
        base[2], base[4] = -0.0, np.float32(np.inf)
        raws[1][2] = raws[2][2] = 0x8000  # -0.0: Δ = +0.0 there, which adds -0.0 or +0.0·(-0.0), no change
    bounds = blocks(n)
    selected = np.ones((3, len(bounds) - 1), np.bool_)
    selected[0, 0] = selected[2, -1] = False
    ds = deltas(base, raws, selected, bounds)
    # unread blocks still add 0·c: +0.0 for expert 0, which turns θ₀'s -0.0 at element 2 into +0.0
    c = np.array([0.5, -1.25, -0.0], np.float32)
    want = np.empty_like(base)
    with np.errstate(all="ignore"):
        if a0 == 1.0:
            np.copyto(want, base)
        else:
            np.multiply(base, np.float32(a0), out=want)
        for d, ck in zip(ds, c):
            want += d * ck
    for inputs in (pass_inputs(raws, [], [G.FROM_DELTA] * 3, [0, 1, 2], selected),
                   pass_inputs([], ds, [G.FROM_VEC] * 3, [0, 1, 2], selected[:1])):
        for t in (1, 2):
            out = np.full_like(base, np.nan)
            with threads(t):
                G.combine_pass(out, base, *inputs, bounds, np.float32(a0), a0 == 1.0, c)
            assert out.tobytes() == want.tobytes()
