"""DARE and DELLA with `rescale: l1 / none` (and DELLA's classic 1/p) against their formulas written plainly here
(docs/SEMANTICS.md, "Rescale (DARE and DELLA)"): numpy on whole tensors, the masks from torch's keyed generator,
the L1 sums by `math.fsum`. The operators' fused kernels must give the same bits for every input form (BF16 and
F32 stored values, θ or Δ given), partial selections, density 1, negative weights, inf and NaN.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator

SHAPES = [((40, 33), 7), ((300,), 300), ((9, 4, 5), 2)]  # (shape, rows per block)
METHODS = ("dare_linear", "dare_ties", "della_linear", "della")


def blocks_of(shape, rpb):
    if len(shape) <= 1:
        return [(0, shape[0] if shape else 1)]
    return [(s, min(shape[0], s + rpb)) for s in range(0, shape[0], rpb)]


def uniforms(seed, key, name, block, n):
    """torch.rand of the block's keyed generator (SEMANTICS.md's recipe), flat."""
    digest = hashlib.sha256(f"{seed}\x1f{key}\x1f{name}\x1f{block}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.rand(n, generator=g, dtype=torch.float32).numpy()


def della_p(delta_rows, d, eps):
    """Keep probabilities of one block (rows × rest): rank of |Δ| in its row by a stable ascending sort."""
    blk = delta_rows.reshape(delta_rows.shape[0], delta_rows.shape[1], -1)
    a = np.abs(blk)
    n = blk.shape[1]
    rank = np.zeros(blk.shape, np.float32)
    for r in range(blk.shape[0]):
        for c in range(blk.shape[2]):
            order = np.argsort(a[r, :, c], kind="stable")
            for pos, j in enumerate(order):
                rank[r, j, c] = pos
    rn = rank / np.float32(n - 1) if n > 1 else np.zeros_like(rank)
    rn = np.clip(rn, 0, 1)
    return ((rn * np.float32(2)) * np.float32(eps) + np.float32(d - eps)).reshape(-1)


def exact_sum(v):
    if np.isnan(v).any():
        return math.nan
    if np.isinf(v).any():
        return math.inf
    return math.fsum(v.astype(np.float64).tolist())


def literal_T(method, mode, base, theta, p, shape, rpb, blocks, seed, name):
    """T_k (flat float32; 0 on rows not read)."""
    delta = (theta - base).reshape(-1)
    T = np.zeros(delta.size, np.float32)
    spans = blocks_of(shape, rpb)
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 0
    if p.density >= 1:
        for b in blocks:
            s, e = spans[b]
            s, e = (s * row, e * row) if row else (0, delta.size)
            T[s:e] = delta[s:e]
        return T
    parts = []
    for b in blocks:
        s, e = spans[b]
        s, e = (s * row, e * row) if row else (0, delta.size)
        u = uniforms(seed, p.key, name, b, e - s)
        if method.startswith("della"):
            rows = delta[s:e].reshape((spans[b][1] - spans[b][0], *shape[1:])) if row else delta[s:e].reshape(1, -1)
            prob = della_p(rows, p.density, p.epsilon if p.epsilon is not None else 0.15)
        else:
            prob = np.float32(p.density)
        parts.append((s, e, u < prob, prob))
    scale = 1.0
    if mode == "l1" and parts:
        a = np.abs(np.concatenate([delta[s:e] for s, e, _k, _p in parts]))
        kept = np.concatenate([k for _s, _e, k, _p in parts])
        before, after = exact_sum(a), exact_sum(np.where(kept, a, np.float32(0)))
        scale = 1.0 if (before < 1e-7 or after < 1e-7) else before / after
    for s, e, keep, prob in parts:
        d = delta[s:e]
        if mode == "classic":
            T[s:e] = np.where(keep, d / prob, np.float32(0))
        elif scale != 1.0:
            T[s:e] = np.where(keep, d * np.float32(scale), np.float32(0))
        else:
            T[s:e] = np.where(keep, d, np.float32(0))
    return T


def literal(method, mode, base, thetas, params, shape, rpb, selected, seed, name, normalize, lam):
    b = base.reshape(-1)
    D = [literal_T(method, mode, base, th, p, shape, rpb, sel, seed, name) * np.float32(p.weight)
         for th, p, sel in zip(thetas, params, selected)]
    zero = np.float32(0)
    if method.endswith("linear"):
        mixed = np.zeros_like(b)
        for x in D:
            mixed = mixed + x
        if normalize:
            W = sum(p.weight for p in params)
            mixed = mixed / np.float32(1.0 if abs(W) < 1e-8 else W)
        return (b + mixed * np.float32(lam)).reshape(shape)
    S = np.zeros_like(b)
    for x in D:
        S = S + x
    pos = S >= 0
    mixed, div = np.zeros_like(b), np.zeros_like(b)
    for x, p in zip(D, params):
        agree = np.where(pos, x > 0, x < 0)
        mixed = mixed + np.where(agree, x, zero)
        div = div + np.where(agree, np.float32(p.weight), zero)
    if normalize:
        mixed = mixed / np.where(div == 0, np.float32(1), div)
    return (b + mixed * np.float32(lam)).reshape(shape)


def to_bf16_bits(x):
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def data(shape, K, seed, special=False, bf16=False):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape).astype(np.float32)
    if bf16:
        base = (to_bf16_bits(base).astype(np.uint32) << 16).view(np.float32)
    thetas = []
    for k in range(K):
        delta = (rng.standard_normal(shape) * np.exp(1.5 * rng.standard_normal(shape)) * 0.02).astype(np.float32)
        delta[rng.random(shape) < 0.2] = 0
        tied = rng.random(shape) < 0.2  # equal magnitudes, both signs
        delta[tied] = np.float32(0.03) * np.sign(rng.standard_normal(int(tied.sum()))).astype(np.float32)
        theta = base + delta
        if special and k == 1:
            flat = theta.reshape(-1)
            flat[3], flat[-5] = np.inf, np.nan
        if special and k == 2:
            theta.reshape(-1)[7] = -np.inf
        if bf16:
            theta = (to_bf16_bits(theta).astype(np.uint32) << 16).view(np.float32)
        thetas.append(theta)
    return base, thetas


def run(method, mode, base, thetas, params, ctx, selected, supply, **kw):
    op = make_operator(method, params, options={"rescale": mode}, **kw)
    op.begin(base, ctx)
    for k, (theta, p, sel) in enumerate(zip(thetas, params, selected)):
        if not sel:
            op.add(ExpertInput(k, p, (), True, base=base))
            continue
        full = len(sel) == ctx.n_blocks
        if supply == "bf16":
            x = ExpertInput.from_raw(k, p, sel, full, base=base, raw=to_bf16_bits(theta), ctx=ctx)
        elif supply == "f32":
            x = ExpertInput.from_raw(k, p, sel, full, base=base, raw=theta.copy(), ctx=ctx)
        elif supply == "delta":
            x = ExpertInput.from_delta(k, p, sel, full, base=base, delta=theta - base)
        else:
            x = ExpertInput(k, p, sel, full, base=base, theta=theta)
        op.add(x)
    return np.array(op.finish()), op


def params_for(method, seed):
    keys = [hashlib.sha256(f"{seed}-{k}".encode()).hexdigest()[:32] for k in range(4)]
    if method.startswith("della"):
        return [ExpertParams(keys[0], 0.7, 0.5, epsilon=0.15), ExpertParams(keys[1], -0.4, 0.3, epsilon=0.1),
                ExpertParams(keys[2], 1.3, 1.0), ExpertParams(keys[3], 0.25, 0.8, epsilon=0.05)]
    return [ExpertParams(keys[0], 0.7, 0.5), ExpertParams(keys[1], -0.4, 0.3),
            ExpertParams(keys[2], 1.3, 1.0), ExpertParams(keys[3], 0.25, 0.9)]


def check(method, mode, shape, rpb, supply, selection, special=False, lam=1.0, normalize=None):
    seed, name = 5, "model.layers.0.w"
    base, thetas = data(shape, 4, 17, special=special, bf16=supply == "bf16")
    params = params_for(method, 3)
    ctx = TensorContext(name=name, shape=shape, rows_per_block=rpb, n_blocks=len(blocks_of(shape, rpb)), seed=seed)
    nb = ctx.n_blocks
    selected = {"full": [tuple(range(nb))] * 4,
                "partial": [tuple(range(0, nb, 2)), (), tuple(range(nb)), tuple(range(1, nb))]}[selection]
    kw = {} if normalize is None else {"normalize": normalize}
    got, op = run(method, mode, base, thetas, params, ctx, selected, supply, lam=lam, **kw)
    want = literal(method, mode, base, thetas, params, shape, rpb, selected, seed, name, op.normalize, lam)
    g, w = got.view(np.int32), want.view(np.int32)
    if not np.array_equal(g, w):
        i = int(np.flatnonzero(g.reshape(-1) != w.reshape(-1))[0])
        raise AssertionError(f"{int((g != w).sum())} of {g.size} differ; first at {i}: "
                             f"{got.reshape(-1)[i]!r} != {want.reshape(-1)[i]!r}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["l1", "none"])
@pytest.mark.parametrize("supply", ["bf16", "f32", "delta"])
@pytest.mark.parametrize("selection", ["full", "partial"])
def test_random_drop_equals_the_plain_formula(method, mode, supply, selection) -> None:
    for shape, rpb in SHAPES:
        check(method, mode, shape, rpb, supply, selection)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("supply", ["f32", "theta"])
def test_random_drop_with_inf_and_nan(method, supply) -> None:
    """A NaN in Δ makes ‖Δ‖₁ NaN and the scale NaN (every kept element NaN); an inf makes it inf or NaN."""
    check(method, "l1", (40, 33), 7, supply, "full", special=True)
    check(method, "none", (40, 33), 7, supply, "partial", special=True)


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_classic_divides_by_the_keep_probability(method) -> None:
    for shape, rpb in SHAPES:
        check(method, "classic", shape, rpb, "bf16", "partial")


@pytest.mark.parametrize("method", ["dare_ties", "della"])
def test_ties_family_normalized_and_lambda(method) -> None:
    check(method, "l1", (40, 33), 7, "bf16", "partial", lam=0.6, normalize=True)
    check(method, "l1", (40, 33), 7, "f32", "full", lam=1.7, normalize=False)


@pytest.mark.parametrize("fuse_bytes", [0, 9_000, 1 << 30])
@pytest.mark.parametrize("mode", ["l1", "none", "classic"])
def test_della_fused_streamed_and_partly_fused(monkeypatch, fuse_bytes, mode) -> None:
    """della keeps each expert's mask (drawn against its row-rank probabilities, the L1 scale found with it)
    for dare_ties' fused pass while its stored values fit `sign_consensus.FUSE_BYTES` (on the 2-D tensor the mask
    packed beside them, on the 3-D one a byte an element counted with them), else folds it block by block
    (9,000 bytes: the kept ones then too, their packed masks unpacked); classic (Δ / p) always block by block:
    the plain formula's bits either way, with rows read in part, normalized, and with inf and NaN."""
    from mergepipe_db.operators import sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    for supply in ("bf16", "f32"):
        check("della", mode, (40, 33), 7, supply, "partial")
        check("della", mode, (40, 33), 7, supply, "full", special=supply == "f32")
        check("della", mode, (9, 4, 5), 2, supply, "full", normalize=True, lam=0.8)


@pytest.mark.parametrize("fuse_bytes", [0, 6_000, 1 << 30])
@pytest.mark.parametrize("mode", ["l1", "none"])
def test_dare_ties_fused_streamed_and_partly_fused(monkeypatch, fuse_bytes, mode) -> None:
    """dare_ties keeps its inputs for one fused pass (`kernels.merge.dare_ties_fused`, the scale found first)
    while they fit `sign_consensus.FUSE_BYTES`, else folds them block by block: the same bits either way."""
    from mergepipe_db.operators import sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    for supply in ("bf16", "f32"):
        check("dare_ties", mode, (40, 33), 7, supply, "partial")
        check("dare_ties", mode, (40, 33), 7, supply, "full", special=supply == "f32")
        check("dare_ties", mode, (9, 4, 5), 2, supply, "full", normalize=True, lam=0.8)


@pytest.mark.parametrize("method", ["dare_linear", "della_linear"])
@pytest.mark.parametrize("group_bytes", [0, 4_000, 9_000, 1 << 30])
@pytest.mark.parametrize("mode", ["l1", "none"])
def test_additive_masks_fused_streamed_and_partly_fused(monkeypatch, method, group_bytes, mode) -> None:
    """dare_linear and della_linear keep each expert's drawn mask (the L1 scale found with it) for one fused
    pass (`kernels.merge.masked_fused`) while its stored values and the mask fit `fold.GROUP_BYTES`, else fold
    it block by block: the plain formula's bits either way, with rows read in part, normalized, and with inf
    and NaN. On the (40, 33) tensor, 4,000 bytes make groups of one BF16 expert (F32 ones streamed) and 9,000
    groups of two BF16 or one F32; the expert of density 1 is kept unmasked, or folded alone by `delta_fused`
    between two groups; the small tensor is one group from 4,000 on."""
    from mergepipe_db.operators import fold

    monkeypatch.setattr(fold, "GROUP_BYTES", group_bytes)
    for supply in ("bf16", "f32"):
        check(method, mode, (40, 33), 7, supply, "partial")
        check(method, mode, (40, 33), 7, supply, "full", special=supply == "f32")
        check(method, mode, (9, 4, 5), 2, supply, "full", normalize=True, lam=0.8)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della_linear", "della"])
@pytest.mark.parametrize("mode", ["l1", "none", "classic"])
def test_dare_blocks_of_several_tiles(method, mode) -> None:
    """DARE's L1 pass (`kernels.merge.dare_keep_blocks`) and dare_ties' fused pass (`dare_ties_fused`) draw each
    block's uniforms three MT19937 twists (1,872) at a time, and the fused passes read packed masks a tile
    (2,048 or 1,872 elements) at a time: blocks of several tiles, a partial last one (6,400 elements), whole
    ones only (7,488) and a 1-D tensor of one block, against torch.rand block by block."""
    for supply in ("bf16", "f32"):
        for shape, rpb in (((300, 64), 100), ((234, 64), 117), ((5000,), 5000)):
            check(method, mode, shape, rpb, supply, "full")
            check(method, mode, shape, rpb, supply, "partial")
