"""Streaming merge operators against a literal, whole-tensor reading of docs/SEMANTICS.md.

The `lit_*` functions below are written from SEMANTICS.md alone: plain torch on whole tensors, loops in
spec order, no streaming, no buffers. At full selection every operator must match them byte for byte
(compared as int32 bit patterns), whatever the data, weights, block layout and input form.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from reference_merge import ordered_dot

from mergepipe_db.core import sketch
from mergepipe_db.errors import SpecError, UnsupportedDtypeError
from mergepipe_db.operators import (
    ExpertInput,
    ExpertParams,
    TensorContext,
    dare_keep_mask,
    make_operator,
    operator_class,
)

METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "slerp", "passthrough")
METHODS_A = ("breadcrumbs_ties", "della", "della_linear", "sce", "nearswap", "ram", "ramplus_tl", "arcee_fusion")
GEOMETRIC = ("model_stock", "nuslerp", "multislerp", "karcher")  # tests/operators/test_geometric.py

# --------------------------------------------------------------------------------------------------
# The literal formulas (SEMANTICS.md), whole tensors
# --------------------------------------------------------------------------------------------------


def lit_weight_sum(weights: Sequence[float]) -> float:
    total = 0.0
    for w in weights:
        total = total + w
    if abs(total) < 1e-8:
        total = 1.0
    return total


def lit_linear(base, thetas, weights, normalize):
    acc = torch.zeros_like(base)
    for theta, w in zip(thetas, weights):
        acc = acc + theta * w
    return acc / lit_weight_sum(weights) if normalize else acc


def lit_task_arithmetic(base, deltas, weights, normalize, lam):
    mixed = torch.zeros_like(base)
    for delta, w in zip(deltas, weights):
        mixed = mixed + delta * w
    if normalize:
        mixed = mixed / lit_weight_sum(weights)
    return base + mixed * lam


def lit_ties_trim(delta, d, tau=None):
    if d >= 1:
        return delta
    n = delta.numel()
    k = int(d * n)
    a = delta.abs()
    if tau is None:
        tau = torch.tensor(math.inf) if k == 0 else torch.topk(a.flatten(), k).values.min()
    return torch.where(a >= tau, delta, 0.0)


def lit_breadcrumbs_trim(delta, d, g):
    if d >= 1:
        return delta
    n = delta.numel()
    target = int(d * n)
    n_top = int(g * n)
    n_bot = n - target - n_top
    if n_bot < 0:
        n_top += n_bot
        n_bot = 0
    a = delta.abs()
    hi = torch.tensor(math.inf) if n_top == 0 else torch.topk(a.flatten(), n_top).values.min()
    lo = torch.tensor(-math.inf) if n_bot == 0 else torch.topk(a.flatten(), n_bot, largest=False).values.max()
    return torch.where((a > lo) & (a < hi), delta, 0.0)


def lit_dare_mask(seed, key, name, shape, rows_per_block, d):
    """Per-block masks concatenated along dim 0 (SEMANTICS.md's generator recipe)."""
    def draw(block_index, block_shape):
        digest = hashlib.sha256(f"{seed}\x1f{key}\x1f{name}\x1f{block_index}".encode()).digest()
        g = torch.Generator(device="cpu")
        g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return torch.rand(block_shape, generator=g, dtype=torch.float32) < d

    if len(shape) == 0:
        return draw(0, ())
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=torch.bool)
    if len(shape) == 1:
        return draw(0, tuple(shape))
    rows = shape[0]
    pieces = [draw(i, (min(rows, s + rows_per_block) - s, *shape[1:]))
              for i, s in enumerate(range(0, rows, rows_per_block))]
    return torch.cat(pieces, dim=0)


def lit_dare_trim(delta, d, mask):
    if d >= 1:
        return delta
    return torch.where(mask, delta / d, 0.0)


def lit_ties_combine(base, trimmed, weights, normalize, lam):
    D = [t * w for t, w in zip(trimmed, weights)]
    S = torch.zeros_like(base)
    for x in D:
        S = S + x
    s = torch.where(S >= 0, 1.0, -1.0)
    mixed = torch.zeros_like(base)
    div = torch.zeros_like(base)
    for x, w in zip(D, weights):
        keep = torch.sign(x) == s
        mixed = mixed + torch.where(keep, x, 0.0)
        div = div + torch.where(keep, w, 0.0)
    div = torch.where(div == 0, 1.0, div)
    if normalize:
        mixed = mixed / div
    return base + mixed * lam


def lit_slerp(theta0, theta1, t):
    n0, n1 = math.sqrt(ordered_dot(theta0, theta0)), math.sqrt(ordered_dot(theta1, theta1))
    dot = ordered_dot(theta0, theta1) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
    if abs(dot) > 0.9995:
        return theta0 * (1 - t) + theta1 * t
    th0 = math.acos(dot)
    s = math.sin(th0)
    tht = th0 * t
    return theta0 * (math.sin(th0 - tht) / s) + theta1 * (math.sin(tht) / s)


DEFAULT_NORMALIZE = {"linear": True, "task_arithmetic": False, "ties": True, "dare_linear": False,
                     "dare_ties": False, "breadcrumbs": False, "breadcrumbs_ties": False, "passthrough": False}


def literal_merge(method, base, thetas, params, *, normalize=None, lam=1.0, t=None, seed=0, name="t",
                  rows_per_block=1):
    """The whole-tensor merge of SEMANTICS.md (θ_k given; omitted rows already equal to the base)."""
    weights = [p.weight for p in params]
    if method == "passthrough":  # the slice's source is θ₀; other models are inputs of no tensor
        return base.clone()
    if method == "slerp":
        return lit_slerp(base, thetas[0], t)
    normalize = DEFAULT_NORMALIZE[method] if normalize is None else normalize
    if method == "linear":
        return lit_linear(base, thetas, weights, normalize)
    deltas = [theta - base for theta in thetas]
    if method == "task_arithmetic":
        return lit_task_arithmetic(base, deltas, weights, normalize, lam)
    if method == "ties":
        return lit_ties_combine(base, [lit_ties_trim(x, p.density) for x, p in zip(deltas, params)],
                                weights, normalize, lam)
    if method == "breadcrumbs":
        return lit_task_arithmetic(base, [lit_breadcrumbs_trim(x, p.density, p.gamma)
                                          for x, p in zip(deltas, params)], weights, normalize, lam)
    if method == "breadcrumbs_ties":
        return lit_ties_combine(base, [lit_breadcrumbs_trim(x, p.density, p.gamma) for x, p in zip(deltas, params)],
                                weights, normalize, lam)
    trimmed = [lit_dare_trim(x, p.density, lit_dare_mask(seed, p.key, name, tuple(base.shape), rows_per_block,
                                                         p.density))
               for x, p in zip(deltas, params)]
    if method == "dare_linear":
        return lit_task_arithmetic(base, trimmed, weights, normalize, lam)
    return lit_ties_combine(base, trimmed, weights, normalize, lam)


# --------------------------------------------------------------------------------------------------
# Driving the streaming operators
# --------------------------------------------------------------------------------------------------


def blocks_of(shape, rows_per_block) -> list[tuple[int, int]]:
    if len(shape) <= 1 or shape[0] == 0:
        return [(0, shape[0] if shape else 1)]
    return [(s, min(shape[0], s + rows_per_block)) for s in range(0, shape[0], rows_per_block)]


def context(shape, rows_per_block, seed=0, name="t") -> TensorContext:
    rpb = rows_per_block if len(shape) >= 2 else max(1, shape[0] if shape else 1)
    return TensorContext(name=name, shape=tuple(shape), rows_per_block=rpb,
                         n_blocks=len(blocks_of(shape, rpb)), seed=seed)


def omit_rows(base, theta, ctx, selected) -> torch.Tensor:
    """θ with the rows of unselected blocks replaced by the base."""
    out = base.clone()
    if selected is None:
        return theta.clone()
    for b in selected:
        s, e = blocks_of(ctx.shape, ctx.rows_per_block)[b]
        if base.dim() == 0:
            out = theta.clone()
        else:
            out[s:e] = theta[s:e]
    return out


def stream(method, base, thetas, params, ctx, *, selected=None, supply="theta", sketches=None, full=None,
           op=None, **kw) -> torch.Tensor:
    """Run the operator; ``selected[k]``: block indices read for expert k (None: all)."""
    op = op or make_operator(method, params, **kw)
    op.begin(base, ctx)
    for k, (theta, p) in enumerate(zip(thetas, params)):
        sel = tuple(range(ctx.n_blocks)) if selected is None or selected[k] is None else tuple(selected[k])
        sk = None if sketches is None else sketches[k]
        is_full = (len(sel) == ctx.n_blocks) if full is None else full
        if not sel:
            x = ExpertInput(k, p, (), is_full, sk, base=base)
        else:
            th = omit_rows(base, theta, ctx, sel)
            if supply == "theta":
                x = ExpertInput(k, p, sel, is_full, sk, base=base, theta=th)
            elif supply == "delta":
                x = ExpertInput.from_delta(k, p, sel, is_full, sk, base=base, delta=th - base)
            else:  # theta, no base given: the operator binds its own
                x = ExpertInput.from_theta(k, p, sel, is_full, sk, theta=th)
        op.add(x)
    return as_torch(op.finish()).clone()  # finish() may return a buffer the next begin() reuses


def as_torch(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Operators return numpy arrays; the reference formulas here are torch."""
    return torch.from_numpy(np.asarray(a, order="C")) if isinstance(a, np.ndarray) else a


def assert_bits_equal(got: np.ndarray | torch.Tensor, want: torch.Tensor) -> None:
    got = as_torch(got)
    assert got.dtype == want.dtype == torch.float32
    assert tuple(got.shape) == tuple(want.shape)
    g, w = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
    if not torch.equal(g, w):
        diff = (g != w).flatten().nonzero()
        i = int(diff[0])
        raise AssertionError(f"{diff.numel()} of {got.numel()} elements differ; first at {i}: "
                             f"{got.flatten()[i].item()!r} != {want.flatten()[i].item()!r}")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

LAYOUTS = [  # (shape, rows_per_block)
    ((), 1),
    ((7,), 7),
    ((13, 5), 3),
    ((64, 33), 7),
    ((5003,), 5003),  # 1-d, above the exact-selection small-tensor cutoff
    ((300, 40), 16),
    ((2, 3, 4), 1),
]


def make_data(shape, K, seed, *, special=False):
    """Base and K experts: heavy-tailed deltas, exact zeros, ties in |Δ| (also ±), sometimes inf/NaN."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    thetas = []
    for k in range(K):
        scale = torch.exp(1.5 * torch.randn(shape, generator=g)) * 0.02
        delta = torch.randn(shape, generator=g) * scale
        u = torch.rand(shape, generator=g)
        delta = torch.where(u < 0.15, torch.zeros_like(delta), delta)
        tied = torch.round(delta * 50) / 50  # many equal magnitudes, both signs
        delta = torch.where((u > 0.15) & (u < 0.45), tied, delta)
        theta = base + delta
        theta = torch.where(u > 0.97, base, theta)  # θ == θ₀ exactly
        if special and theta.numel() > 4:
            flat = theta.view(-1)
            flat[(k * 7) % flat.numel()] = math.inf
            flat[(k * 11 + 3) % flat.numel()] = -math.inf
            flat[(k * 13 + 5) % flat.numel()] = math.nan
        thetas.append(theta)
    return base, thetas


def make_params(K, seed, *, method="ties"):
    rng = np.random.default_rng(seed)
    params = []
    for k in range(K):
        w = float(rng.choice([1.0, 0.5, -0.7, 0.3, 2.5, -1.25, 0.1]))
        d = float(rng.choice([1.0, 0.5, 0.37, 0.9, 0.05, 0.001, 0.995]))
        gamma = float(rng.choice([0.01, 0.0, 0.1]))  # 0.995 + 0.01: breadcrumbs' n_bot < 0 case
        params.append(ExpertParams(key=hashlib.sha256(f"{seed}-{k}".encode()).hexdigest()[:32], weight=w,
                                   density=d, gamma=gamma))
    return params


# --------------------------------------------------------------------------------------------------
# Full selection: bit-exact
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_full_selection_matches_literal_formulas(method: str) -> None:
    case = 0
    for i, (shape, rpb) in enumerate(LAYOUTS):
        # K = 1..5, two of them per layout
        for K in ((1,) if method == "slerp" else (1 + i % 5, 1 + (i + 2) % 5)):
            case += 1
            seed = 1000 * METHODS.index(method) + case
            base, thetas = make_data(shape, K, seed)
            params = make_params(K, seed)
            ctx = context(shape, rpb, seed=seed % 7)
            kw = {"t": [0.0, 0.3, 0.5, 1.0][case % 4]} if method == "slerp" else {}
            if method != "slerp" and case % 3 == 0:
                kw["normalize"] = not DEFAULT_NORMALIZE[method]
            if method not in ("slerp", "linear") and case % 2:
                kw["lam"] = 0.75
            want = literal_merge(method, base, thetas, params, seed=ctx.seed, rows_per_block=ctx.rows_per_block,
                                 **kw)
            for supply in ("theta", ("delta", "theta-no-base")[case % 2]):
                got = stream(method, base, thetas, params, ctx, supply=supply, **kw)
                if supply == "delta" and operator_class(method).uses_theta:
                    # θ is then θ₀ + Δ, which may differ from the stored θ by a rounding
                    thetas2 = [base + (th - base) for th in thetas]
                    want2 = literal_merge(method, base, thetas2, params, seed=ctx.seed,
                                          rows_per_block=ctx.rows_per_block, **kw)
                    assert_bits_equal(got, want2)
                else:
                    assert_bits_equal(got, want)


@pytest.mark.parametrize("method", ["ties", "breadcrumbs", "dare_ties", "dare_linear", "task_arithmetic",
                                    "linear"])
def test_full_selection_with_inf_and_nan(method: str) -> None:
    for i, (shape, rpb) in enumerate(LAYOUTS[2:]):
        base, thetas = make_data(shape, 3, 77 + i, special=True)
        params = make_params(3, 5 + i)
        ctx = context(shape, rpb, seed=3)
        want = literal_merge(method, base, thetas, params, seed=3, rows_per_block=ctx.rows_per_block)
        assert_bits_equal(stream(method, base, thetas, params, ctx), want)


@pytest.mark.parametrize("method", METHODS)
def test_empty_tensors_and_other_base_dtypes(method: str) -> None:
    for shape, rpb in (((0, 5), 2), ((5, 0), 2), ((0,), 1), ((9, 4), 2)):
        K = 1 if method == "slerp" else 2
        base, thetas = make_data(shape, K, 3)
        params = make_params(K, 3)
        kw = {"t": 0.5} if method == "slerp" else {}
        ctx = context(shape, rpb)
        want = literal_merge(method, base, thetas, params, rows_per_block=rpb, **kw)
        assert_bits_equal(stream(method, base, thetas, params, ctx, **kw), want)
    base16 = base.to(torch.bfloat16)
    thetas16 = [th.to(torch.bfloat16) for th in thetas]
    want = literal_merge(method, base16.float(), [t.float() for t in thetas16], params, rows_per_block=rpb, **kw)
    op = make_operator(method, params, **kw)
    op.begin(base16, ctx)  # upcast to float32 first, as SEMANTICS.md says
    for k, p in enumerate(params):
        op.add(ExpertInput(k, p, range(ctx.n_blocks), True, base=base16, theta=thetas16[k]))
    assert_bits_equal(op.finish(), want)


def test_nan_in_delta_with_ties_threshold() -> None:
    # τ = topk(...).values.min() is NaN as soon as one |Δ| is NaN: that expert keeps nothing
    shape, rpb = (100, 50), 10
    base, thetas = make_data(shape, 2, 9)
    thetas[0].view(-1)[17] = math.nan
    params = [ExpertParams("a", 1.0, 0.5), ExpertParams("b", 0.5, 0.3)]
    ctx = context(shape, rpb)
    for method in ("ties", "breadcrumbs"):
        assert_bits_equal(stream(method, base, thetas, params, ctx), literal_merge(method, base, thetas, params))


def test_many_ties_and_constant_magnitudes() -> None:
    shape, rpb = (128, 64), 8
    base = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    signs = torch.where(torch.rand(shape, generator=torch.Generator().manual_seed(4)) < 0.5, -1.0, 1.0)
    thetas = [base + signs * 0.25, base + signs * torch.tensor(1e-30), base.clone(), base + 3.0]
    params = [ExpertParams(str(k), w, d, 0.05) for k, (w, d) in enumerate([(1, .5), (2, .3), (1, .2), (-1, .9)])]
    ctx = context(shape, rpb)
    for method in ("ties", "breadcrumbs", "dare_ties", "dare_linear"):
        assert_bits_equal(stream(method, base, thetas, params, ctx), literal_merge(method, base, thetas, params,
                                                                                    rows_per_block=rpb))


def test_operator_is_reusable_across_tensors_and_shapes() -> None:
    params = make_params(3, 11)
    for method in METHODS:
        ps = params[:1] if method == "slerp" else params
        kw = {"t": 0.4} if method == "slerp" else {}
        op = make_operator(method, ps, **kw)
        for i, (shape, rpb) in enumerate([((150, 40), 16), ((7,), 7), ((64, 33), 7), ((150, 40), 16)]):
            base, thetas = make_data(shape, len(ps), 500 + i)
            ctx = context(shape, rpb, seed=i, name=f"layer.{i}")
            got = stream(method, base, thetas, ps, ctx, op=op)
            want = literal_merge(method, base, thetas, ps, seed=i, name=f"layer.{i}", rows_per_block=rpb, **kw)
            assert_bits_equal(got, want)
            got.fill_(0.0)  # the caller owns the result: scribbling on it must not disturb the next tensor


def test_protocol_misuse_is_reported() -> None:
    params = make_params(2, 1)
    base, thetas = make_data((4, 4), 2, 1)
    ctx = context((4, 4), 2)
    op = make_operator("task_arithmetic", params)
    with pytest.raises(RuntimeError):
        op.add(ExpertInput(0, params[0], (), True))
    op.begin(base, ctx)
    with pytest.raises(ValueError, match="spec order"):
        op.add(ExpertInput(1, params[1], (0, 1), True, base=base, theta=thetas[1]))
    op.add(ExpertInput(0, params[0], (0, 1), True, base=base, theta=thetas[0]))
    with pytest.raises(RuntimeError):
        op.finish()
    with pytest.raises(ValueError):
        ExpertInput(0, params[0], (0,), True, base=base)  # blocks selected but no data


# --------------------------------------------------------------------------------------------------
# Partial selection
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "dare_linear", "dare_ties", "ties",
                                    "breadcrumbs"])
def test_omitted_rows_behave_as_zero_delta(method: str) -> None:
    rng = np.random.default_rng(5)
    for i, (shape, rpb) in enumerate([((64, 33), 7), ((300, 40), 16), ((13, 5), 3)]):
        K = 3
        base, thetas = make_data(shape, K, 40 + i)
        params = make_params(K, 40 + i)
        ctx = context(shape, rpb, seed=2)
        selected = [sorted(rng.choice(ctx.n_blocks, size=int(rng.integers(0, ctx.n_blocks)), replace=False).tolist())
                    for _ in range(K)]
        eff = [omit_rows(base, th, ctx, sel) for th, sel in zip(thetas, selected)]
        # no sketch: global statistics come from the rows read, the rest counting as Δ = 0
        want = literal_merge(method, base, eff, params, seed=2, rows_per_block=rpb)
        for supply in ("theta", "delta"):
            got = stream(method, base, thetas, params, ctx, selected=selected, supply=supply)
            if supply == "delta" and method == "linear":
                want_l = literal_merge(method, base, [base + (t - base) for t in eff], params)
                assert_bits_equal(got, want_l)
            else:
                assert_bits_equal(got, want)


def test_slerp_omitted_tensor_means_base() -> None:
    base, thetas = make_data((13, 5), 1, 3)
    ctx = context((13, 5), 3)
    params = make_params(1, 3)
    got = stream("slerp", base, thetas, params, ctx, selected=[()], t=0.3)
    assert_bits_equal(got, lit_slerp(base, base.clone(), 0.3))


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_omitted_update_bound(method: str) -> None:
    rng = np.random.default_rng(9)
    shape, rpb = (120, 30), 8
    for trial in range(6):
        K = int(rng.integers(1, 5))
        base, thetas = make_data(shape, K, 60 + trial)
        params = make_params(K, 60 + trial)
        kw = {"normalize": bool(trial % 2)} | ({"lam": 0.6} if method == "task_arithmetic" else {})
        ctx = context(shape, rpb)
        op = make_operator(method, params, **kw)
        selected = [sorted(rng.choice(ctx.n_blocks, size=int(rng.integers(0, ctx.n_blocks + 1)),
                                      replace=False).tolist()) for _ in range(K)]
        full = stream(method, base, thetas, params, ctx, **kw)
        part = stream(method, base, thetas, params, ctx, selected=selected, **kw)
        bound = 0.0
        for k in range(K):
            for b, (s, e) in enumerate(blocks_of(shape, rpb)):
                if b not in selected[k]:
                    bound += op.coefficient(k) * float(torch.linalg.vector_norm((thetas[k][s:e] - base[s:e]).double()))
        dev = float(torch.linalg.vector_norm((part - full).double()))
        assert dev <= bound * (1 + 1e-5) + 1e-6 * float(torch.linalg.vector_norm(full.double()))


def test_ties_exact_when_skipped_blocks_cannot_reach_the_threshold() -> None:
    """Blocks whose max |Δ| is below the sketch's lower bound of τ contribute nothing: skipping them
    (a partial selection with the sketch) still gives the full-read result, bit for bit."""
    shape, rpb = (400, 32), 10
    base, thetas = make_data(shape, 3, 21)
    # make half of the blocks small so the planner can skip them
    for k, th in enumerate(thetas):
        d = th - base
        for b, (s, e) in enumerate(blocks_of(shape, rpb)):
            if (b + k) % 2:
                d[s:e] *= 1e-3
        thetas[k] = base + d
    params = [ExpertParams(str(k), w, dens) for k, (w, dens) in enumerate([(1.0, 0.2), (0.6, 0.1), (-0.4, 0.3)])]
    ctx = context(shape, rpb)
    sketches, selected = [], []
    for th, p in zip(thetas, params):
        d = (th - base).abs()
        h = sum(sketch.histogram(d[s:e]) for s, e in blocks_of(shape, rpb))
        lb = sketch.lower_bound_kth_largest(h, int(p.density * d.numel()))
        sel = [b for b, (s, e) in enumerate(blocks_of(shape, rpb)) if float(d[s:e].max()) >= lb]
        assert 0 < len(sel) < ctx.n_blocks
        sketches.append(h)
        selected.append(sel)
    want = literal_merge("ties", base, thetas, params)
    got = stream("ties", base, thetas, params, ctx, selected=selected, sketches=sketches, full=False)
    assert_bits_equal(got, want)


def test_partial_selection_uses_the_sketch_threshold() -> None:
    shape, rpb = (200, 50), 10
    base, thetas = make_data(shape, 2, 31)
    params = [ExpertParams("a", 1.0, 0.3), ExpertParams("b", -0.5, 0.6)]
    ctx = context(shape, rpb)
    selected = [[0, 3, 4, 5, 12], [1, 2, 19]]
    sketches = [sketch.histogram(th - base) for th in thetas]
    got = stream("ties", base, thetas, params, ctx, selected=selected, sketches=sketches, full=False)
    trimmed = []
    for th, p, sel, h in zip(thetas, params, selected, sketches):
        d = omit_rows(base, th, ctx, sel) - base
        k = int(p.density * d.numel())
        tau = torch.tensor(float(np.float32(sketch.kth_largest(h, k))))
        true = torch.topk((th - base).abs().flatten(), k).values.min()
        assert sketch.bin_index(tau.reshape(1)) == sketch.bin_index(true.reshape(1))  # τ's bin is exact
        trimmed.append(lit_ties_trim(d, p.density, tau=tau))
    assert_bits_equal(got, lit_ties_combine(base, trimmed, [p.weight for p in params], True, 1.0))
    # the sketch is only used when the read is partial: a full expert ignores it
    full = stream("ties", base, thetas, params, ctx, sketches=[np.zeros(sketch.NBINS, np.int64)] * 2)
    assert_bits_equal(full, literal_merge("ties", base, thetas, params))


def expected_sketch_tau(delta_full, delta_read, h, k):
    """SEMANTICS.md under a partial read: τ from the sketch. Its bin is exact; when every element of that
    bin was read the value is exact too, otherwise it is interpolated in the bin (float32). A NaN seen
    among the rows read makes τ NaN, as topk(...).values.min() would."""
    if torch.isnan(delta_read).any():
        return math.nan
    b, _ = sketch.locate_kth_largest(h, k)
    if b == 0:
        return 0.0
    bins_read = sketch.bin_index(delta_read.abs())
    if int((bins_read == b).sum()) == int(h[b]):
        return float(torch.sort(delta_full.abs().flatten(), descending=True).values[k - 1])
    return float(np.float32(sketch.kth_largest(h, k)))


@pytest.mark.parametrize("seed", range(6))
def test_partial_ties_with_sketch_in_all_regimes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape, rpb = (120, 40), 10
    base, thetas = make_data(shape, 3, 300 + seed, special=seed >= 4)
    if seed == 2:  # mostly zeros: τ = 0 (bin 0) is known exactly from the sketch
        thetas = [torch.where(torch.rand(shape) < 0.9, base, th) for th in thetas]
    if seed == 3:  # huge updates: τ in the last bin
        thetas = [base + (th - base) * 1e7 for th in thetas]
    params = [ExpertParams(str(k), float(rng.choice([1.0, -0.5])), float(rng.choice([0.3, 0.6, 0.95])))
              for k in range(3)]
    ctx = context(shape, rpb)
    selected = [sorted(rng.choice(ctx.n_blocks, size=int(rng.integers(1, ctx.n_blocks)), replace=False).tolist())
                for _ in range(3)]
    if seed == 5:
        selected[0] = list(range(ctx.n_blocks))  # all read but flagged partial: the sketch still decides
    sketches = [sketch.histogram(th - base) for th in thetas]
    got = stream("ties", base, thetas, params, ctx, selected=selected, sketches=sketches, full=False)
    trimmed = []
    for th, p, sel, h in zip(thetas, params, selected, sketches):
        d_read = omit_rows(base, th, ctx, sel) - base
        k = int(p.density * d_read.numel())
        rows = blocks_of(shape, rpb)
        tau = expected_sketch_tau(th - base, torch.cat([d_read[rows[b][0]:rows[b][1]] for b in sel]), h, k)
        trimmed.append(lit_ties_trim(d_read, p.density, tau=torch.tensor(tau)))
    assert_bits_equal(got, lit_ties_combine(base, trimmed, [p.weight for p in params], True, 1.0))


@pytest.mark.parametrize("case", ["all_read", "bin_read", "some_read", "nan_read", "zero", "zero_nan", "zero_inf"])
def test_partial_ties_sketch_tau_in_one_pass(monkeypatch, case: str) -> None:
    """A partly read tensor whose sketch holds no inf/NaN takes τ from one fused pass over the rows read
    (`TiesFold._sketch_tau_fast`; for τ = 0, the operator's fused pass checks the rows read): the same bits
    as the |Δ|-in-memory path and as SEMANTICS.md, in each branch: every element of τ's bin read (exact),
    only some (interpolated), τ in bin 0, and a NaN or inf read that the sketch did not announce (NaN: τ =
    NaN, T_k = 0; inf: τ stays 0)."""
    from mergepipe_db.operators.sign_consensus import TiesFold

    shape, rpb = (160, 30), 10
    base, thetas = make_data(shape, 2, 77)
    ctx = context(shape, rpb)
    # low densities: τ's bin is high, and not every block holds an element of it
    params = [ExpertParams("a", 1.0, 0.004), ExpertParams("b", -0.7, 0.01)]
    rows = blocks_of(shape, rpb)
    if case.startswith("zero"):  # most of each tensor unchanged: the k-th largest |Δ| is 0
        params = [ExpertParams("a", 1.0, 0.5), ExpertParams("b", -0.7, 0.6)]
        g = torch.Generator().manual_seed(5)
        thetas = [torch.where(torch.rand(shape, generator=g) < 0.8, base, th) for th in thetas]
    sketches = [sketch.histogram(th - base) for th in thetas]
    everything = list(range(ctx.n_blocks))
    if case == "all_read":
        selected = [everything, everything]
    elif case == "bin_read":  # exactly the blocks holding an element of τ's bin (and those above it)
        selected = []
        for th, p, h in zip(thetas, params, sketches):
            b, _ = sketch.locate_kth_largest(h, int(p.density * th.numel()))
            bins = sketch.bin_index((th - base).abs())
            selected.append([j for j in everything if bool((bins[rows[j][0]:rows[j][1]] >= b).any())])
        assert all(len(sel) < ctx.n_blocks for sel in selected)
    else:
        selected = [[0, 3, 4, 9, 12], [1, 2, 15]]
    if case in ("nan_read", "zero_nan", "zero_inf"):
        thetas = [th.clone() for th in thetas]
        thetas[0][rows[3][0] + 1, 5] = math.inf if case == "zero_inf" else math.nan  # read, not in the sketch
    taken: list[float | None] = []
    fused = TiesFold._sketch_tau_fast

    def spy(self, x, k):  # noqa: ANN001, ANN202
        tau, zero_check = fused(self, x, k)
        taken.append(tau)
        return tau, zero_check

    monkeypatch.setattr(TiesFold, "_sketch_tau_fast", spy)
    got = stream("ties", base, thetas, params, ctx, selected=selected, sketches=sketches, full=False)
    taken = taken[:2]  # an input the fused pass sends back asks again (then by the other path)
    assert len(taken) == 2 and all(t is not None for t in taken)
    assert all(t == 0.0 for t in taken) == case.startswith("zero")
    monkeypatch.setattr(TiesFold, "_sketch_tau_fast", lambda self, x, k: (None, 0))
    assert_bits_equal(got, stream("ties", base, thetas, params, ctx, selected=selected, sketches=sketches,
                                  full=False))
    trimmed = []
    for th, p, sel, h, t in zip(thetas, params, selected, sketches, taken):
        d_read = omit_rows(base, th, ctx, sel) - base
        k = int(p.density * d_read.numel())
        tau = expected_sketch_tau(th - base, torch.cat([d_read[rows[b][0]:rows[b][1]] for b in sel]), h, k)
        assert (math.isnan(tau) and (math.isnan(t) or case == "zero_nan")) or tau == t
        trimmed.append(lit_ties_trim(d_read, p.density, tau=torch.tensor(tau)))
    assert_bits_equal(got, lit_ties_combine(base, trimmed, [p.weight for p in params], True, 1.0))
    if case == "nan_read":
        assert math.isnan(taken[0])


@pytest.mark.parametrize("n", [0, 1, 2, 623, 624, 625, 1248, 1249, 6 * 12, 256 * 2048 + 7])
def test_mt19937_uniforms_are_torch_rand_bit_for_bit(n) -> None:
    """DARE's uniforms come from mergepipe_db.kernels.torch_rand, not torch: the same bits as torch.rand for a generator
    given manual_seed(s), for seeds over the whole 63-bit range (torch keeps the low 32 bits) and sizes
    around MT19937's 624-word state."""
    from mergepipe_db.kernels.torch_rand import torch_rand_into

    rng = np.random.default_rng(n)
    for seed in [0, 1, 2**32 - 1, 2**32, 2**63 - 1, *rng.integers(0, 2**63 - 1, size=6).tolist()]:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        want = torch.rand(n, generator=g, dtype=torch.float32).numpy()
        got = np.full(n, np.nan, np.float32)
        torch_rand_into(seed, got)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), seed


@pytest.mark.parametrize("threads", [1, 2])
def test_block_uniforms_drawn_in_parallel_are_torch_rand_of_each_block(threads) -> None:
    """`torch_rand_blocks_into` draws blocks on numba's threads: each block is torch.rand of its own generator,
    packed in order (empty blocks included), whatever the thread count."""
    import numba

    from mergepipe_db.kernels.torch_rand import torch_rand_blocks_into

    sizes = [5, 0, 624, 1249, 3, 700]
    seeds = [7, 2**40 + 3, 11, 2**63 - 1, 0, 99]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    got = np.full(int(bounds[-1]), np.nan, np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        torch_rand_blocks_into(seeds, bounds, got)
    finally:
        numba.set_num_threads(before)
    for seed, s, e in zip(seeds, bounds[:-1], bounds[1:]):
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        want = torch.rand(int(e - s), generator=g, dtype=torch.float32).numpy()
        assert np.array_equal(got[s:e].view(np.uint32), want.view(np.uint32)), seed


def test_dare_mask_is_deterministic_and_block_local() -> None:
    shape, rpb = (50, 12), 6
    ctx = context(shape, rpb, seed=5)
    m1 = dare_keep_mask(5, "abc", "w", 3, (6, 12), 0.4)
    m2 = dare_keep_mask(5, "abc", "w", 3, (6, 12), 0.4)
    assert m1.dtype == torch.bool and m1.shape == (6, 12) and torch.equal(m1, m2)
    assert not torch.equal(m1, dare_keep_mask(5, "abc", "w", 4, (6, 12), 0.4))
    assert not torch.equal(m1, dare_keep_mask(6, "abc", "w", 3, (6, 12), 0.4))
    assert not torch.equal(m1, dare_keep_mask(5, "abd", "w", 3, (6, 12), 0.4))
    assert dare_keep_mask(1, "k", "scalar", 0, (), 0.5).shape == ()
    full_mask = lit_dare_mask(5, "abc", "w", shape, rpb, 0.4)
    for b, (s, e) in enumerate(blocks_of(shape, rpb)):
        assert torch.equal(full_mask[s:e], dare_keep_mask(5, "abc", "w", b, (e - s, 12), 0.4))
    # a block's result does not depend on which other blocks were read
    base, thetas = make_data(shape, 2, 8)
    params = [ExpertParams("abc", 0.7, 0.4), ExpertParams("def", -0.2, 0.7)]
    full = stream("dare_linear", base, thetas, params, ctx)
    for sel in ([2], [0, 5, 8], [1, 2, 3, 4]):
        part = stream("dare_linear", base, thetas, params, ctx, selected=[sel, sel])
        for b in sel:
            s, e = blocks_of(shape, rpb)[b]
            assert_bits_equal(part[s:e], full[s:e])


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "experts", "kw"), [
    ("ties", [ExpertParams("a", 1.0, 0.0)], {}),
    ("ties", [ExpertParams("a", 1.0, 1.5)], {}),
    ("dare_linear", [ExpertParams("a", 1.0, -0.2)], {}),
    ("linear", [ExpertParams("a", 1.0, math.nan)], {}),
    ("task_arithmetic", [ExpertParams("a", math.inf)], {}),
    ("task_arithmetic", [ExpertParams("a", "heavy")], {}),  # type: ignore[arg-type]
    ("breadcrumbs", [ExpertParams("a", 1.0, 0.5, -0.1)], {}),
    ("ties", [], {}),
    ("task_arithmetic", [ExpertParams("a")], {"lam": math.inf}),
    ("slerp", [ExpertParams("a"), ExpertParams("b")], {"t": 0.5}),
    ("slerp", [ExpertParams("a")], {}),
    ("slerp", [ExpertParams("a")], {"t": 1.5}),
    ("dare_ties", [ExpertParams("", 1.0, 0.5)], {}),
    ("magic", [ExpertParams("a")], {}),
])
def test_bad_parameters_raise_spec_error(method, experts, kw) -> None:
    with pytest.raises(SpecError) as info:
        make_operator(method, experts, **kw)
    assert "\n" not in str(info.value)


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(SpecError, match="breadcrumbs.*dare_linear.*linear.*slerp.*task_arithmetic.*ties"):
        make_operator("model_soup", [ExpertParams("a")])


def test_registry_methods_are_the_spec_methods() -> None:
    """The registry's names are exactly what a spec may name (`core.spec.METHODS`, which cannot import the
    operators) and what this file tests; each name gives its own class, and a name registers once."""
    from mergepipe_db.core import spec
    from mergepipe_db.operators import methods, register

    # issue 35's methods have their own tests (tests/integration/test_methods_a.py, test_geometric.py, the MergeKit
    # suites)
    assert sorted(methods()) == sorted(spec.METHODS) == sorted(METHODS + METHODS_A + GEOMETRIC)
    assert len(set(spec.METHODS)) == len(spec.METHODS)
    for m in METHODS:
        assert operator_class(m).name == m
        assert type(make_operator(m, [ExpertParams("a")], t=0.5)) is operator_class(m)
    with pytest.raises(SpecError, match="unknown merge method"):
        operator_class("model_soup")
    with pytest.raises(ValueError, match="already registered"):
        register("ties")(type("Again", (operator_class("ties"),), {}))
    assert operator_class("ties").name == "ties"


def test_importing_the_operators_loads_neither_torch_nor_numba() -> None:
    """The family modules register on import, and stay light: `mergepipe --help` must not pay for torch or
    numba (the kernels load on first use)."""
    import subprocess
    import sys

    code = ("import sys, mergepipe_db.operators as o; o.make_operator('ties', [o.ExpertParams('a')]); "
            "print(sorted(m for m in ('torch', 'numba', 'mergepipe_db.kernels.merge') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_private_name_of_the_operators_is_imported_elsewhere() -> None:
    """Modules use each other's public names only: nothing imports an underscore name of an operators module,
    and the operators modules import none of any other module (function-local imports count)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    bad = []
    seen = 0
    for top in ("mergepipe_db", "tests", "benchmarks"):
        for path in (root / top).rglob("*.py"):
            seen += 1
            rel = path.relative_to(root)
            in_ops = rel.parts[:2] == ("mergepipe_db", "operators")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom) or not node.module:
                    continue
                ours = node.module.startswith("mergepipe_db.operators")
                if ours or (in_ops and node.module.startswith("mergepipe_db")):
                    bad += [f"{rel}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert seen > 100  # the walk found the tree (a wrong root would pass vacuously)
    assert bad == []


def test_family_modules_do_not_import_each_other() -> None:
    """Each family module (one per kind of method) builds on the shared modules only: a method is added or
    changed in its own module."""
    import ast
    import pathlib

    families = {"linear", "additive", "sign_consensus", "geometric"}
    ops_dir = pathlib.Path(__file__).resolve().parents[2] / "mergepipe_db" / "operators"
    for fam in families:
        tree = ast.parse((ops_dir / f"{fam}.py").read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        others = {f"mergepipe_db.operators.{f}" for f in families - {fam}}
        assert not imported & others, fam


def test_flags_defaults_and_coefficients() -> None:
    assert {m for m in METHODS if operator_class(m).additive} == {"linear", "task_arithmetic"}
    assert {m for m in METHODS if operator_class(m).uses_theta} == {"linear", "slerp"}
    assert {m for m in METHODS if operator_class(m).tensor_granular} == {"slerp"}
    assert {m for m in METHODS if operator_class(m).needs_full_tensor_stats} == {"ties", "breadcrumbs"}
    ps = [ExpertParams("a", 2.0), ExpertParams("b", -1.0), ExpertParams("c", 3.0)]
    for m, norm in DEFAULT_NORMALIZE.items():
        assert make_operator(m, ps).normalize is norm
    assert make_operator("linear", ps, lam=5.0).coefficient(1) == pytest.approx(1 / 4)
    assert make_operator("linear", ps, normalize=False).coefficient(2) == 3.0
    assert make_operator("task_arithmetic", ps, lam=0.5).coefficient(1) == 0.5
    assert make_operator("task_arithmetic", ps, lam=0.5, normalize=True).coefficient(0) == pytest.approx(0.25)
    assert make_operator("ties", ps).coefficient(2) == pytest.approx(0.75)
    assert make_operator("linear", [ExpertParams("a", 1.0), ExpertParams("b", -1.0)]).coefficient(0) == 1.0
    assert make_operator("slerp", ps[:1], t=0.25).coefficient(0) == 0.25


def test_expert_input_lazy_theta_and_delta() -> None:
    shape, rpb = (10, 4), 3
    base, thetas = make_data(shape, 1, 2)
    ctx = context(shape, rpb)
    p = ExpertParams("a")
    x = ExpertInput(0, p, [3, 1], False, base=base, theta=omit_rows(base, thetas[0], ctx, [1, 3]), ctx=ctx)
    assert x.selected_blocks == (1, 3)
    assert x.selected_row_ranges(ctx) == [(3, 6), (9, 10)]
    assert ExpertInput(0, p, [0, 1, 2], True, base=base, theta=base).selected_row_ranges(ctx) == [(0, 9)]
    d = x.delta
    assert d is x.delta  # cached
    want = omit_rows(base, thetas[0], ctx, [1, 3]) - base
    assert_bits_equal(d, want)
    y = ExpertInput.from_delta(0, p, [1, 3], False, base=base, delta=want, ctx=ctx)
    th = as_torch(y.theta)
    assert torch.equal(th[:3].view(torch.int32), base[:3].view(torch.int32))  # omitted rows: θ₀ itself
    assert_bits_equal(th[3:6], base[3:6] + want[3:6])
    none = ExpertInput(0, p, (), False, base=base)
    assert none.theta is None and none.delta is None


def test_input_errors() -> None:
    base = torch.zeros(6, 4)
    ctx = context((6, 4), 2)
    p = ExpertParams("a")
    with pytest.raises(ValueError, match="out of range"):
        ctx.block_rows(3)
    with pytest.raises(ValueError, match="single block"):
        context((7,), 7).block_rows(1)
    with pytest.raises(UnsupportedDtypeError):
        ExpertInput(0, p, (0,), False, base=base, theta=torch.zeros(6, 4, dtype=torch.int32))
    op = make_operator("task_arithmetic", [p])
    with pytest.raises(ValueError, match="shape"):
        op.begin(torch.zeros(6, 5), ctx)
    op.begin(base, ctx)
    with pytest.raises(ValueError, match="shape"):
        op.add(ExpertInput(0, p, (0,), False, theta=torch.zeros(5, 4)))
    with pytest.raises(SpecError):
        make_operator("ties", [{"weight": 1.0}])  # type: ignore[list-item]
    # without a context, lazy θ/Δ are plain whole-tensor sums
    th = torch.randn(6, 4)
    x = ExpertInput(0, p, (0, 1, 2), True, base=base + 1, theta=th)
    assert torch.equal(as_torch(x.delta), th - (base + 1))
    assert torch.equal(as_torch(ExpertInput(0, p, (0,), True, base=base, delta=th).theta), base + th)
    with pytest.raises(ValueError, match="base"):
        _ = ExpertInput(0, p, (0,), True, theta=th).delta


@pytest.mark.parametrize("small", [16, 1 << 20])
def test_exact_selection_equals_sort(monkeypatch, small: int) -> None:
    """The radix select behind TIES/breadcrumbs thresholds (and the sort below `RADIX_SMALL`): the k-th of
    torch's descending sort (NaN first)."""
    from mergepipe_db.operators import order_stats

    monkeypatch.setattr(order_stats, "RADIX_SMALL", small)
    op = make_operator("ties", [ExpertParams("a")])
    g = torch.Generator().manual_seed(0)
    for case in range(3):
        a = (torch.randn(9001, generator=g) * torch.exp(3 * torch.randn(9001, generator=g))).abs()
        a[torch.rand(9001, generator=g) < 0.2] = 0.0
        a[:3000] = torch.round(a[:3000] * 4) / 4  # ties
        if case == 2:
            a[[5, 77, 4000]] = torch.tensor([math.inf, math.nan, math.nan])
        desc = torch.sort(a, descending=True).values
        for k in [1, 3, 4, 4500, 9000, 9001]:
            got = order_stats.kth_largest_exact(a.numpy(), k, op, {})
            want = float(desc[k - 1])
            assert (math.isnan(got) and math.isnan(want)) or got == want


@pytest.mark.parametrize("fuse_bytes", [0, 1 << 30])
@pytest.mark.parametrize("case", ["in_bin", "mostly_unchanged", "wrong_sketch", "zero_claimed", "zero_claimed_nan"])
def test_full_selection_tau_from_the_sketch_is_exact(monkeypatch, case: str, fuse_bytes: int) -> None:
    """On a full read, TIES takes τ's bin from the catalog sketch (one pass over that bin, or a count when τ
    is 0, made by the fused pass when the inputs are kept for it) — and a sketch the data contradicts is
    ignored: the result is the literal formula's, bit for bit, fused (1 GiB) or streamed (0)."""
    from mergepipe_db.operators import sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    shape, rpb = (300, 64), 16
    base, thetas = make_data(shape, 3, 77)
    if case != "in_bin" and case != "wrong_sketch":  # most Δ exactly 0, as in BF16 fine-tunes: τ = 0 at
        for th in thetas[::2] if case.startswith("zero_claimed") else thetas:  # density 0.5
            th.view(-1)[: th.numel() * 3 // 4] = base.view(-1)[: th.numel() * 3 // 4]
    params = [ExpertParams("a", 0.5, 0.5), ExpertParams("b", 0.3, 0.2), ExpertParams("c", -0.2, 0.7)]
    ctx = context(shape, rpb)
    sketches = [sketch.histogram(th - base) for th in thetas]
    if case == "wrong_sketch":  # right total, wrong bins: moves counts one bin up
        sketches = [np.roll(h, 1) for h in sketches]
    if case.startswith("zero_claimed"):  # expert b's sketch says all unchanged (τ = 0); its bytes changed
        sketches[1] = np.zeros(sketch.NBINS, np.int64)
        sketches[1][0] = base.numel()
        if case == "zero_claimed_nan":  # ... and expert a's bytes hold a NaN its sketch does not show
            thetas[0].view(-1)[5] = math.nan
    got = stream("ties", base, thetas, params, ctx, sketches=sketches)
    assert_bits_equal(got, literal_merge("ties", base, thetas, params))


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("group_bytes", [0, 40_000, 1 << 30])
def test_grouped_fused_and_streamed_additive_paths_match(monkeypatch, method: str, group_bytes: int) -> None:
    """linear and task arithmetic keep experts' values up to `fold.GROUP_BYTES` and fold each group in one fused
    pass (0: each expert streamed; 40 kB: groups of one or two, experts that selected nothing in between;
    1 GiB: one pass): every split gives the literal result, bit for bit."""
    from mergepipe_db.operators import fold

    monkeypatch.setattr(fold, "GROUP_BYTES", group_bytes)
    shape, rpb = (120, 64), 16
    base, thetas = make_data(shape, 5, 93)
    params = [ExpertParams(n, w) for n, w in zip("abcde", (0.5, 0.3, -0.2, 0.25, 0.15))]
    ctx = context(shape, rpb)
    for selected in (None, [[0, 1, 5], [], [1, 2, 7], [], [0, 7]], [[], [3], [], [], [2]]):
        got = stream(method, base, thetas, params, ctx, selected=selected, full=True if selected else None)
        thetas_read = [omit_rows(base, th, ctx, sel) for th, sel in zip(thetas, selected or [None] * 5)]
        assert_bits_equal(got, literal_merge(method, base, thetas_read, params))


@pytest.mark.parametrize("fuse_bytes", [0, 40_000])
def test_ties_streaming_and_partly_fused_paths_match(monkeypatch, fuse_bytes: int) -> None:
    """TIES folds the experts of a tensor in one fused pass while their bytes fit `sign_consensus.FUSE_BYTES`, else one
    by one (or the first few fused, then streamed): every mix gives the literal result, bit for bit."""
    from mergepipe_db.operators import sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    shape, rpb = (120, 64), 16
    base, thetas = make_data(shape, 3, 91)
    params = [ExpertParams("a", 0.5, 0.4), ExpertParams("b", 0.3, 1.0), ExpertParams("c", -0.2, 0.7)]
    ctx = context(shape, rpb)
    for selected in (None, [[0, 1, 5], [], [1, 2, 7]]):
        got = stream("ties", base, thetas, params, ctx, selected=selected, full=True if selected else None)
        thetas_read = [omit_rows(base, th, ctx, sel) for th, sel in zip(thetas, selected or [None] * 3)]
        assert_bits_equal(got, literal_merge("ties", base, thetas_read, params))


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize("fuse_bytes", [0, 40_000, 1 << 30])
@pytest.mark.parametrize("special", [False, True])
def test_breadcrumbs_band_fused_or_streamed_is_the_literal_formula(monkeypatch, method: str, fuse_bytes: int,
                                                                   special: bool) -> None:
    """breadcrumbs and breadcrumbs_ties keep each input with its band lo < |Δ| < hi for their fused pass
    (`kernels.merge.delta_fused`, `ties_fused`: the band as its float32 neighbours inward) while the bytes fit
    (`fold.GROUP_BYTES`, `sign_consensus.FUSE_BYTES`), else fold it at once (`masked_delta`): every mix gives
    the literal formula, bit for bit, with ties among the |Δ| at the cut points, and with inf/NaN (no fused
    band: the order-statistics path)."""
    from mergepipe_db.operators import fold, sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    monkeypatch.setattr(fold, "GROUP_BYTES", fuse_bytes)
    shape, rpb = (120, 64), 16
    base, thetas = make_data(shape, 4, 57, special=special)
    g = torch.Generator().manual_seed(5)
    base = torch.round(base * 4) / 4  # Δ in multiples of 1/64, exact: runs of equal |Δ| of both signs at the cuts
    thetas = [base + torch.randint(-9, 10, shape, generator=g).float() / 64 if not special else th for th in thetas]
    params = [ExpertParams("a", 0.5, 0.4, gamma=0.05), ExpertParams("b", -0.3, 0.9, gamma=0.01),
              ExpertParams("c", 1.2, 0.995, gamma=0.01), ExpertParams("d", 0.7, 1.0)]
    ctx = context(shape, rpb)
    for selected in (None, [[0, 1, 5], [], [1, 2, 7], [0, 7]]):
        got = stream(method, base, thetas, params, ctx, selected=selected, full=True if selected else None)
        thetas_read = [omit_rows(base, th, ctx, sel) for th, sel in zip(thetas, selected or [None] * 4)]
        assert_bits_equal(got, literal_merge(method, base, thetas_read, params))


@pytest.mark.parametrize("fuse_bytes", [0, 40_000, 1 << 30])
@pytest.mark.parametrize("special", [False, True])
def test_dare_ties_streaming_and_fused_paths_match(monkeypatch, fuse_bytes: int, special: bool) -> None:
    """dare_ties folds its experts in one fused pass that draws each block's uniforms a tile at a time
    (`kernels.merge.dare_ties_fused`) while their bytes fit `sign_consensus.FUSE_BYTES`, else block by block: streamed
    (0), partly fused (40 kB) or fused (1 GiB), with a density-1 expert (no mask) among them, inf and NaN
    deltas, and blocks of 4 × 700 elements (the generator's 624-word state and the 2,048-element tile
    boundaries fall inside blocks): the literal result, bit for bit."""
    from mergepipe_db.operators import sign_consensus

    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", fuse_bytes)
    shape, rpb = (22, 700), 4
    base, thetas = make_data(shape, 3, 97, special=special)
    params = [ExpertParams("a", 0.5, 0.4), ExpertParams("b", 0.3, 1.0), ExpertParams("c", -0.2, 0.7)]
    ctx = context(shape, rpb, seed=11)
    for selected in (None, [[0, 1, 5], [], [1, 2, 4]]):
        got = stream("dare_ties", base, thetas, params, ctx, selected=selected, full=True if selected else None)
        thetas_read = [omit_rows(base, th, ctx, sel) for th, sel in zip(thetas, selected or [None] * 3)]
        assert_bits_equal(got, literal_merge("dare_ties", base, thetas_read, params, seed=11,
                                             rows_per_block=rpb))


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "ties"])
def test_held_inputs_are_released_once_folded(monkeypatch, method: str) -> None:
    """An operator reports as held only the inputs still waiting for a fused pass: the executor gives the
    others' buffers back, so memory stays bounded by one group, not by the number of experts."""
    from mergepipe_db.operators import fold, sign_consensus

    shape, rpb = (120, 64), 16  # 30,720 bytes of float32 per expert: two fit in 70 kB
    monkeypatch.setattr(fold, "GROUP_BYTES", 70_000)
    monkeypatch.setattr(sign_consensus, "FUSE_BYTES", 70_000)
    base, thetas = make_data(shape, 5, 95)
    params = [ExpertParams(n, 0.2, 0.5) for n in "abcde"]
    ctx = context(shape, rpb)
    op = make_operator(method, params)
    op.begin(base, ctx)
    held = []
    for k, (theta, p) in enumerate(zip(thetas, params)):
        op.add(ExpertInput(k, p, tuple(range(ctx.n_blocks)), True, None, base=base, theta=theta))
        held.append(set(op.held_inputs()))
    got = op.finish()
    assert op.held_inputs() == frozenset()
    if method == "ties":  # one fused pass while the inputs fit, then streamed
        assert held == [{0}, {0, 1}, set(), set(), set()]
    else:  # groups of two
        assert held == [{0}, {0, 1}, {2}, {2, 3}, {4}]
    assert_bits_equal(got, literal_merge(method, base, thetas, params))


@pytest.mark.parametrize("method", [m for m in METHODS if m != "slerp"])
@pytest.mark.parametrize("normalize,lam", [(None, 1.0), (True, 0.7), (False, -1.3)])
def test_base_only_table_is_the_result_where_no_expert_was_read(method, normalize, lam) -> None:
    """`base_only_table` (what the executor writes on blocks no expert selected) is, for every one of the
    65,536 BF16 values of θ₀, bit for bit: the operator's own result when no expert selects anything, and,
    where θ₀ is finite, the literal formula with θ_k = θ₀ (an inf θ₀ gives Δ = inf - inf = NaN there, not the
    Δ = 0 of an unread block)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    base = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().reshape(256, 256)
    params = make_params(3, 11, method=method)
    op = make_operator(method, params, normalize=normalize, lam=lam)
    table = torch.from_numpy(op.base_only_table().copy()).reshape(256, 256)
    ctx = context((256, 256), 16)
    op.begin(base, ctx)
    for k, p in enumerate(params):
        op.add(ExpertInput(k, p, (), False, base=base))
    assert_bits_equal(table, as_torch(op.finish()).clone())
    want = literal_merge(method, base, [base.clone() for _ in params], params, normalize=normalize, lam=lam)
    finite = torch.isfinite(base)
    assert torch.equal(table[finite].view(torch.int32), want[finite].view(torch.int32))
    assert make_operator("slerp", [ExpertParams("a")], t=0.5).base_only_table() is None


def test_passthrough_scale_and_no_expert() -> None:
    """passthrough: θ₀ * scale (a Python float, torch's float32 product) with or without inputs; a copy of θ₀,
    bit for bit, without a scale (no expert needed: a slice of one model)."""
    from mergepipe_db.operators.by_name import operator_from_params

    shape, rpb = (40, 9), 8
    base, _thetas = make_data(shape, 1, 21, special=True)
    ctx = context(shape, rpb)
    for scale in (None, 0.0, 0.37, -2.0):
        op = operator_from_params("passthrough", [], {} if scale is None else {"scale": scale})
        op.begin(base, ctx)
        want = base.clone() if scale is None else base * scale
        assert_bits_equal(op.finish(), want)


def test_one_thread_pool_tasks_run_on_one_thread_whatever_another_thread_set(monkeypatch) -> None:
    """A worker of the one-thread torch pool takes torch's thread count, at its first torch call, from the count
    another thread set last (here 2, after the worker started); a task of the pool still runs on one thread, so
    its sums keep a single thread's order."""
    from mergepipe_db.operators import base

    monkeypatch.setattr(base, "_torch_pools", [])  # a fresh pool, its worker yet to make a torch call
    pool = base.one_thread_torch_pool()
    before = torch.get_num_threads()
    try:
        pool.submit(lambda: None).result()  # the worker exists
        torch.set_num_threads(2)
        assert pool.submit(torch.get_num_threads).result() == 1
    finally:
        torch.set_num_threads(before)
        pool.shutdown()
