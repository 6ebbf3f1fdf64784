"""The whole-tensor kernels (`kernels/gather.py`) give the bits of the numpy/torch formulas they replace: the
gathered Δ_k / θ_k, nearswap's formula, ram's and ramplus_tl's counts and combination, arcee_fusion's
importance, quantiles and result (the operator against torch's formula with its sort, on tensors below and
above the sampling size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from builders import f32_bits

from mergepipe_db.kernels import gather as kern
from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator
from mergepipe_db.operators.fusion import QUANTILE_SAMPLE_SIZE, sample_seed


def _bf16(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _widen(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("stored", ["bf16", "f32"])
@pytest.mark.parametrize("n,ranges", [
    (1000, [[0, 10], [100, 350], [900, 990]]),
    # several threaded chunks: ranges across chunk boundaries, one inside a chunk, one ending at the end
    (600_000, [[5, 140_000], [262_100, 262_200], [300_000, 450_001], [599_000, 600_000]]),
    (600_000, [[0, 600_000]]),
    (600_000, np.zeros((0, 2), np.int64)),
])
def test_gathered_delta_and_theta_are_the_stored_values_on_the_ranges_only(stored, n, ranges) -> None:
    g = np.random.default_rng(1)
    base = g.standard_normal(n).astype(np.float32)
    raw = g.standard_normal(n).astype(np.float32)
    raw = _bf16(raw) if stored == "bf16" else raw
    theta = _widen(raw) if stored == "bf16" else raw
    ranges = np.array(ranges, np.int64).reshape(-1, 2)
    on = np.zeros(n, np.bool_)
    for s, e in ranges:
        on[s:e] = True
    raw_junk = raw.copy()
    raw_junk[~on] = raw_junk[0]  # bytes outside the ranges are never read
    delta = np.full(n, np.nan, np.float32)
    kern.gather_delta(delta, base, raw_junk, ranges)
    assert np.array_equal(f32_bits(delta), f32_bits(np.where(on, theta - base, np.float32(0.0))))
    out = np.full(n, np.nan, np.float32)
    kern.gather_theta(out, base, raw_junk, ranges)
    assert np.array_equal(f32_bits(out), f32_bits(np.where(on, theta, base)))


def _ram_numpy(base, deltas, eps, r=None, alpha=None):
    """The numpy formula the kernels replace (as ram.py had it): bool factors, +0.0-started sum in order."""
    with np.errstate(all="ignore"):
        return _ram_numpy_terms(base, deltas, eps, r, alpha)


def _ram_numpy_terms(base, deltas, eps, r, alpha):
    nz = [np.abs(d) > eps for d in deltas]
    c = np.zeros(base.shape, np.int64)
    for m in nz:
        c += m
    unique, overlap = c == 1, c > 1
    denom = np.maximum(c, 1).astype(np.float32)
    acc = np.zeros_like(base)
    counts = []
    for d, m in zip(deltas, nz):
        lam = 1.0
        if r is not None:
            shared, uniq = int(np.count_nonzero(m & overlap)), int(np.count_nonzero(m & unique))
            counts.append((shared, uniq))
            lam = 1.0 + r * min(max(shared / max(float(uniq), eps), 0.0), alpha)
        z = np.where(m, d, np.float32(0.0))
        u = z * unique
        if lam != 1.0:
            u = u * np.float32(lam)
        acc = acc + (u + (z * overlap) / denom)
    return base + acc, counts


@pytest.mark.parametrize("n_experts,n", [(1, 3 * 1024 + 77), (2, 3 * 1024 + 77), (3, 3 * 1024 + 77),
                                          (8, 3 * 1024 + 77), (9, 3 * 1024 + 77), (3, (1 << 17) * 5 + 333)])
@pytest.mark.parametrize("eps", [1e-3, 0.0, -1e-3, 0.1])
def test_ram_kernels_give_the_numpy_formulaf32_bits(n_experts, n, eps) -> None:
    """Tiles and a tail; the last case spans five chunks of numba's threads (`merge.PAR_CHUNK`)."""
    g = np.random.default_rng(n_experts)
    base = g.standard_normal(n).astype(np.float32)
    base[:7] = -0.0
    deltas = np.empty((n_experts, n), np.float32)
    for k in range(n_experts):
        d = (g.standard_normal(n) * 0.01).astype(np.float32)
        d[g.integers(0, n, n // 3)] = 0.0
        d[g.integers(0, n, 20)] = np.float32(abs(eps)) * g.choice([-1, 1])  # |Δ| == |ε|
        d[g.integers(0, n, 20)] = np.float32(0.1)  # ε = 0.1: compared in float32, not float64
        d[g.integers(0, n, 5)] = -0.0
        d[g.integers(0, n, 3)] = np.inf
        d[g.integers(0, n, 3)] = np.nan
        deltas[k] = d
    r, alpha = 0.3, 5.0
    for scaled in (False, True) if eps > 0 else (False,):  # ramplus_tl refuses ε <= 0
        want, counts = _ram_numpy(base, list(deltas), eps, *((r, alpha) if scaled else (None, None)))
        lam = np.ones(n_experts, np.float32)
        if scaled:
            shared = np.zeros(n_experts, np.int64)
            unique = np.zeros(n_experts, np.int64)
            kern.ram_counts(deltas, np.float32(eps), shared, unique)
            assert list(zip(shared.tolist(), unique.tolist())) == counts
            for k, (sh, un) in enumerate(counts):
                lam[k] = 1.0 + r * min(max(sh / max(float(un), eps), 0.0), alpha)
        out = np.empty(n, np.float32)
        kern.ram_combine(out, base, deltas, np.float32(eps), lam)
        assert np.array_equal(f32_bits(out), f32_bits(want))


@pytest.mark.parametrize("stored", ["bf16", "f32"])
@pytest.mark.parametrize("n_experts,n", [(1, 3 * 1024 + 77), (2, 3 * 1024 + 77), (8, 3 * 1024 + 77),
                                          (9, 3 * 1024 + 77), (3, (1 << 17) * 5 + 333)])
@pytest.mark.parametrize("r,alpha", [(0.3, 5.0), (-7.0, 0.2), (-5.0, 0.2)])
def test_ramplus_one_pass_from_stored_values_gives_the_numpy_formula(stored, n_experts, n, r, alpha) -> None:
    """ramplus_tl from stored values: counts and formula in one pass (`ramplus_raw`), then the elements one expert
    alone updates (`ramplus_unique`): the numpy formula's bits and counts, for λ_k > 1, λ_k < 0 (r = -7) and,
    where ρ_k >= α, λ_k = 0 exactly (r = -5), with ±inf, NaN, |Δ| == ε, -0.0 in Δ and θ₀, and tiles some
    experts did not read (their Δ_k = +0.0 there, whatever is stored)."""
    from mergepipe_db.kernels.merge import RAW_TILE, pack

    g = np.random.default_rng(n_experts * 7 + n)
    eps = 1e-3
    base = g.standard_normal(n).astype(np.float32)
    base = _widen(_bf16(base)) if stored == "bf16" else base
    base[:7] = -0.0
    n_tiles = -(-n // RAW_TILE)
    read = (g.random((n_experts, n_tiles)) < 0.8).astype(np.uint8)
    raws, deltas = [], []
    for k in range(n_experts):
        d = (g.standard_normal(n) * 0.01).astype(np.float32)
        d[g.integers(0, n, n // 3)] = 0.0
        d[g.integers(0, n, 20)] = np.float32(eps) * g.choice([-1, 1])
        theta = base + d
        theta = _widen(_bf16(theta)) if stored == "bf16" else theta
        theta[g.integers(0, n, 5)] = base[g.integers(0, n, 5)]  # unchanged elements
        theta[g.integers(0, n, 3)] = np.inf
        theta[g.integers(0, n, 3)] = -np.inf
        theta[g.integers(0, n, 3)] = np.nan
        on = np.repeat(read[k], RAW_TILE)[:n].astype(bool)
        delta = np.where(on, theta - base, np.float32(0.0))
        junk = np.where(on, theta, np.float32(123.0))  # unread tiles: never looked at
        raws.append(_bf16(junk) if stored == "bf16" else junk)
        deltas.append(delta)
    want, counts = _ram_numpy(base, deltas, eps, r, alpha)
    if alpha < 1 and n_experts > 1:  # a λ_k at its clamp (0 for r = -5; one expert shares nothing: ρ = 0)
        assert any(sh / max(un, eps) >= alpha for sh, un in counts)
    shared = np.zeros(n_experts, np.int64)
    unique = np.zeros(n_experts, np.int64)
    out = np.full(n, np.nan, np.float32)
    code = np.zeros(n, np.uint8)
    kern.ramplus_raw(out, code, base, pack(raws), read, n_experts, np.float32(eps), shared, unique)
    assert list(zip(shared.tolist(), unique.tolist())) == counts
    lam = np.array([1.0 + r * min(max(sh / max(float(un), eps), 0.0), alpha) for sh, un in counts], np.float32)
    kern.ramplus_unique(out, code, base, lam)
    assert np.array_equal(f32_bits(out), f32_bits(want))


def test_kth_smallest_is_the_sorted_value() -> None:
    g = np.random.default_rng(2)
    cases = {
        "normal": g.standard_normal(200_000).astype(np.float32),
        "mostly zeros": np.where(g.random(300_000) < 0.9, np.float32(0.0),
                                 np.abs(g.standard_normal(300_000)).astype(np.float32) * 1e-9),
        "signed zeros and tiny": np.concatenate([np.zeros(1000, np.float32), -np.zeros(1000, np.float32),
                                                 np.array([1e-45, -1e-45, np.inf, -np.inf], np.float32),
                                                 g.standard_normal(5000).astype(np.float32) * 1e-40]),
        "all equal": np.full(10_000, np.float32(3.5)),
        "one": np.array([-2.0], np.float32),
    }
    for name, a in cases.items():
        n = a.size
        ks = np.array(sorted({int(q * (n - 1)) for q in (0.0, 0.25, 0.5, 0.75, 1.0)} | {n // 2, n // 2 + 1} - {n}),
                      np.int64)
        got = np.empty(ks.size, np.float32)
        kern.kth_smallest(a, ks, got)
        want = np.sort(a)[ks]
        assert np.array_equal(got, want), name  # equal values (a zero's sign is the sort's choice)


def _arcee_torch(base: np.ndarray, theta: np.ndarray, seed: int, name: str) -> np.ndarray:
    """arcee_fusion in torch, with the sort (docs/SEMANTICS.md), as fusion.py computed it before the kernels."""
    t0, t1 = torch.from_numpy(base), torch.from_numpy(theta)
    diff = (t1 - t0).abs()
    p = F.softmax(t1, dim=-1) + 1e-8
    q = F.softmax(t0, dim=-1) + 1e-8
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    importance = diff * kl
    flat = importance.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE_SIZE:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sample_seed(seed, name))
        flat = flat[torch.randint(flat.numel(), (QUANTILE_SAMPLE_SIZE,), generator=gen)]
    srt, _ = torch.sort(flat)
    qs = (torch.tensor([0.25, 0.5, 0.75]) * (srt.numel() - 1)).long()
    q1, median, q3 = srt[qs]
    threshold = median + 1.5 * (q3 - q1)
    return (t0 + (t1 - t0) * (importance >= threshold).float()).numpy()


@pytest.mark.parametrize("shape,plant", [((300, 64), None), ((40,), None), ((3, 4, 50), None),
                                         ((200, 64), "equal rows"), ((200, 64), "nan"),
                                         ((2100, 512), "equal rows"), ((2100, 512), "nan"),
                                         ((2100, 512), "late nan")])
def test_arcee_fusion_gives_the_torch_formulaf32_bits(shape, plant) -> None:
    torch.set_num_threads(1)
    g = np.random.default_rng(3)
    base = _widen(_bf16(g.standard_normal(shape) * 0.02))
    theta = base + (g.standard_normal(shape) * 0.003).astype(np.float32)
    theta = _widen(_bf16(theta))  # BF16 rounding: many Δ exactly 0, importance ties at 0
    if plant == "equal rows":
        theta.reshape(-1, shape[-1])[::3] = base.reshape(-1, shape[-1])[::3]  # kl = 0: a third of the importances 0
    elif plant == "nan":
        theta[5, 7] = np.nan  # a NaN row: torch's sort places NaN last
    elif plant == "late nan":
        theta[-3, 500] = np.nan  # in the importance pass's last chunk of rows
    n_rows = shape[0] if len(shape) > 1 else 1
    ctx = TensorContext(name="w", shape=shape, rows_per_block=n_rows if len(shape) > 1 else 1, n_blocks=1, seed=4)
    op = make_operator("arcee_fusion", [ExpertParams("e0")])
    op.begin(base, ctx)
    op.add(ExpertInput.from_raw(0, None, (0,), True, raw=_bf16(theta)))
    got = op.finish()
    assert np.array_equal(f32_bits(got), f32_bits(_arcee_torch(base, theta, 4, "w")))
    if plant is None:
        assert not np.array_equal(got, base) and not np.array_equal(got, theta)  # the mask keeps some, not all


def _nearswap_numpy(a: np.ndarray, b: np.ndarray, t: float) -> np.ndarray:
    """nearswap as numpy writes it (the formula the kernel replaced)."""
    w = np.float32(t) / np.maximum(np.abs(a - b), np.float32(1e-6))
    np.clip(w, np.float32(0), np.float32(1), out=w)
    return w * b + (np.float32(1) - w) * a


@pytest.mark.parametrize("n", [1, 1000, (1 << 17) * 3 + 17])
@pytest.mark.parametrize("t", [0.001, 0.0, -0.0, -0.5, 2.0, 1e-7, float("inf")])
def test_nearswap_is_numpys_formula_bit_for_bit(n: int, t: float) -> None:
    g = np.random.default_rng(n)
    a = (g.standard_normal(n) * 0.02).astype(np.float32)
    b = a + (g.standard_normal(n) * 1e-3).astype(np.float32)
    b[g.random(n) < 0.1] = 0.0
    if n > 20:  # NaN, infinities of both signs, equal infinities, signed zeros
        a[3], b[5], a[7], b[9] = np.nan, np.inf, -np.inf, np.nan
        a[11] = b[11] = np.inf
        a[13], b[13] = 0.0, -0.0
        b[15] = a[15]
    out = np.empty(n, np.float32)
    kern.nearswap(out, a, b, np.float32(t))
    with np.errstate(all="ignore"):
        assert np.array_equal(f32_bits(out), f32_bits(_nearswap_numpy(a, b, t)))


@pytest.mark.parametrize("n", [1, 7, 1000, 1_000_001, 123_456_789])
def test_randint_gather_is_torch_randint_then_index(n: int) -> None:
    """arcee_fusion's quantile sample (`torch_rand.randint_gather`): the values at ``torch.randint(n, (m,),
    generator=g)`` for ``g.manual_seed(seed)``, seeds beyond 32 bits included, compared with torch itself."""
    from mergepipe_db.kernels import torch_rand

    values = (np.arange(n, dtype=np.float32) if n > 5_000_000
              else np.random.default_rng(n).standard_normal(n).astype(np.float32))
    for seed in (0, 5, 2**40 + 17, 2**63 - 1):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        want = torch.from_numpy(values)[torch.randint(n, (200_003,), generator=gen)].numpy()
        got = np.empty(200_003, np.float32)
        torch_rand.randint_gather(values, np.int64(seed), got)
        assert got.tobytes() == want.tobytes(), seed


@pytest.mark.parametrize("shape", [(40,), (3, 17), (2100, 512), (7, 100_003), (2, 1 << 20), (4, 3, 50)])
def test_torch_softmax_rows_have_the_same_bits_on_any_thread_count(shape) -> None:
    """arcee_fusion runs torch's softmax on every core (`fusion.py`): torch computes each row on one thread,
    so the bits equal a one-thread run's. Checked here against this torch's kernels, wide rows included."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = F.softmax(x, dim=-1)
        torch.set_num_threads(max(2, before))
        many = F.softmax(x, dim=-1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int32), many.view(torch.int32))


@pytest.mark.parametrize("shape", [(300, 7), (129, 100), (64, 2048), (9, 5632), (1000, 33), (5, 1)])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_kl_by_aligned_row_slices_is_one_call(shape, parts) -> None:
    """arcee_fusion's KL terms on row slices, one thread each (`fusion.row_slices`: starts at multiples of
    `SLICE_ALIGN` elements), equal one call of the same torch operations on the whole tensor, bit for bit:
    checked here against this torch's kernels, odd widths included."""
    from mergepipe_db.operators.fusion import SLICE_ALIGN, kl_rows, row_slices

    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    p0 = F.softmax(torch.randn(shape, generator=g) * 3, dim=-1)
    q0 = F.softmax(torch.randn(shape, generator=g) * 3, dim=-1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        p, q = p0.clone(), q0.clone()
        want = torch.sum(torch.div(p.add_(1e-8), q.add_(1e-8), out=q).log_().mul_(p), dim=-1, keepdim=True)
        want_terms = q
        p, q = p0.clone(), q0.clone()
        got = torch.empty(shape[0], 1)
        slices = row_slices(shape[0], shape[1], parts)
        assert all(a * shape[1] % SLICE_ALIGN == 0 for a, _ in slices)
        assert slices[0][0] == 0 and slices[-1][1] == shape[0]
        for a, b in slices:
            kl_rows(p[a:b], q[a:b], got[a:b], 1e-8)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(q.view(torch.int32), want_terms.view(torch.int32))


@pytest.mark.parametrize("shape", [(300, 7), (129, 100), (64, 2048), (9, 5632), (1000, 33), (5, 1), (3, 100_003)])
@pytest.mark.parametrize("elements", [1000, 4096])
def test_kl_by_row_chunks_is_the_formula_on_the_whole_tensor(shape, elements) -> None:
    """arcee_fusion's softmaxes and KL a chunk of rows at a time (`fusion.kl_by_row_chunks`, chunks by
    `row_chunks`) equal the formula's torch calls on the whole tensor, bit for bit: checked on this torch, odd
    widths and rows wider than a chunk included."""
    from mergepipe_db.operators.fusion import SLICE_ALIGN, kl_by_row_chunks, row_chunks

    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    t0, t1 = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g) * 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        p, q = F.softmax(t1, dim=-1) + 1e-8, F.softmax(t0, dim=-1) + 1e-8
        want = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
        chunks = row_chunks(shape[0], shape[1], elements)
        assert all(a * shape[1] % SLICE_ALIGN == 0 for a, _ in chunks)
        assert chunks[0][0] == 0 and chunks[-1][1] == shape[0]
        assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
        if shape[0] * shape[1] >= 4 * elements and shape[1] % 64 == 0:
            assert len(chunks) >= 4  # cut where the rows allow it
        longest = max(b - a for a, b in chunks) * shape[1]
        got = torch.full((shape[0], 1), float("nan"))
        kl_by_row_chunks(t0, t1, got, chunks, (torch.empty(longest), torch.empty(longest)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
