"""The geometric family (model_stock, nuslerp, multislerp, karcher; slerp's Gram form): the streamed operators
against plain torch formulas written here from docs/SEMANTICS.md (whole tensors, float32 as MergeKit computes
them), within 1e-6 relative; the Gram-matrix coefficient form against the same formulas; options and bad
parameters. (slerp's full read is tested bit for bit in tests/operators/test_operators.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mergepipe_db.errors import SpecError
from mergepipe_db.operators import ExpertInput, ExpertParams, TensorContext, make_operator
from mergepipe_db.operators.geometric import (
    gram,
    karcher_coefficients,
    karcher_float32,
    model_stock_coefficients,
    multislerp_coefficients,
    nuslerp_coefficients,
    slerp_coefficients,
)

SHAPES = [(7,), (13, 5), (64, 33), (2, 3, 4), (300, 40)]


# --- plain formulas ---------------------------------------------------------------------------------------


def ref_model_stock(base, thetas, filter_wise=False):
    shape = base.shape
    if filter_wise:
        w0 = base.reshape(1, -1) if base.dim() == 1 else base
        ws = [t.reshape(1, -1) if t.dim() == 1 else t for t in thetas]
    else:
        w0, ws = base.reshape(-1), [t.reshape(-1) for t in thetas]
    offs = [w - w0 for w in ws]
    coss = []
    for i in range(len(offs)):
        for j in range(i + 1, len(offs)):
            np_ = torch.norm(offs[i], dim=-1) * torch.norm(offs[j], dim=-1)
            coss.append(((offs[i] * offs[j]).sum(dim=-1) / np_.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(coss).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    den = 1 + (n - 1) * cos
    sing = den.abs() < 1e-6
    t = torch.where(sing, torch.zeros_like(cos), n * cos / torch.where(sing, torch.ones_like(den), den))
    return (t * (sum(ws) / n) + (1 - t) * w0).reshape(shape)


def ref_nuslerp(base, thetas, weights, flatten=True, row_wise=False):
    total = weights[0] + weights[1]
    t = 0.5 if abs(total) < 1e-6 else weights[1] / total
    v0, v1 = thetas[0] - base, thetas[1] - base
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = (u0 * u1).sum(dim=-1, keepdim=True).clamp(-1, 1)
    col = (1 - cos.square()) <= 1e-16
    th = torch.acos(torch.where(col, 0, cos))
    res = (torch.sin((1 - t) * th) * v0 + torch.sin(t * th) * v1) / torch.sin(th)
    res = torch.where(col, (1 - t) * v0 + t * v1, res)
    if row_wise and not flatten:
        res = res.transpose(0, -1)
    return base + res.reshape(shape)


def ref_multislerp(base, thetas, weights, normalize=True, eps=1e-8):
    if len(thetas) == 1:
        return thetas[0]
    ts = torch.stack(thetas) - base
    flat = ts.view(ts.shape[0], -1)
    w = torch.tensor(weights, dtype=torch.float32)
    if normalize:
        w = w / w.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean = mean / torch.norm(mean)
    dots = (units * mean).sum(-1, keepdim=True)
    tang = ((units - dots * mean) * w.view(-1, 1)).sum(0)
    tn = torch.norm(tang) + eps
    res = mean * torch.cos(tn) + tang * (torch.sin(tn) / tn)
    return (res * (norms.squeeze(-1) * w).sum()).view(base.shape) + base


def ref_karcher(tensors, max_iter=10, tol=1e-5):
    n = len(tensors)
    norms = [torch.linalg.vector_norm(t) for t in tensors]
    units = [t / nm for t, nm in zip(tensors, norms)]
    mean = sum(u / n for u in units)  # every test tensor has a norm above tol
    mean = mean / torch.linalg.vector_norm(mean)
    for _ in range(max_iter):
        tang = torch.zeros_like(mean)
        for u in units:
            dot = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            th = torch.arccos(dot)
            if th.item() < tol:
                continue
            tang = tang + (1.0 / n) * (th / torch.sin(th)) * (u - dot * mean)
        tn = torch.linalg.vector_norm(tang)
        if tn.item() < tol:
            break
        mean = torch.cos(tn) * mean + torch.sin(tn) * (tang / tn)
        mean = mean / torch.linalg.vector_norm(mean)
    return sum(nm / n for nm in norms) * mean


def torch_karcher_float32(tensors, max_iter, tol):
    """karcher's full-read loop as plain float32 torch operations on one thread (each step allocating its
    result), the definition `karcher_float32` must equal bit for bit: inputs with norm <= tol left out, angles
    < tol skipped, the base given last by the operator."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _torch_karcher_loop(tensors, max_iter, tol)
    finally:
        torch.set_num_threads(threads)


def _torch_karcher_loop(tensors, max_iter, tol):
    ts = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)) for t in tensors]
    n = len(ts)
    alphas = [1.0 / n] * n
    norms = [torch.linalg.vector_norm(t) for t in ts]
    units = [torch.zeros_like(t) if float(nm) == 0.0 else t / nm for t, nm in zip(ts, norms)]
    valid = [i for i in range(n) if float(norms[i]) > tol]
    if not valid:
        return np.zeros_like(tensors[0])
    total = sum(alphas[i] for i in valid)
    na = [alphas[i] / total for i in valid]
    vu = [units[i] for i in valid]
    mean = torch.zeros_like(vu[0])
    for a, u in zip(na, vu):
        mean += a * u
    mn = torch.linalg.vector_norm(mean)
    mean = vu[0].clone() if float(mn) < tol else mean / mn
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for a, u in zip(na, vu):
            dot = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            th = torch.arccos(dot)
            if float(th) < tol:
                continue
            tangent += a * (th / torch.sin(th)) * (u - dot * mean)
        tn = torch.linalg.vector_norm(tangent)
        if float(tn) < tol:
            break
        mean = torch.cos(tn) * mean + torch.sin(tn) * (tangent / tn)
        un = torch.linalg.vector_norm(mean)
        if float(un) > tol:
            mean = mean / un
    scale = sum(a * nm for a, nm in zip(alphas, norms))
    return (scale * mean).numpy()


# --- helpers ---------------------------------------------------------------------------------------------


def data(shape, k, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    common = torch.randn(shape, generator=g) * scale  # correlated task vectors: cosines well away from 0
    return base, [base + common + torch.randn(shape, generator=g) * scale for _ in range(k)]


def stream(method, base, thetas, weights=None, *, selected=None, rows=None, **options):
    params = [ExpertParams(str(k), weight=1.0 if weights is None else weights[k]) for k in range(len(thetas))]
    op = make_operator(method, params, options=options)
    n_rows = base.shape[0] if base.dim() >= 2 else 1
    ctx = TensorContext("t", tuple(base.shape), 1, n_rows, seed=0)  # one block per row (1-d: one block)
    op.begin(base.numpy(), ctx)
    for k, th in enumerate(thetas):
        if selected is not None and k not in selected:
            op.add(ExpertInput(k, params[k], (), False, base=base.numpy()))
        elif rows is not None:  # these blocks (rows) only; θ_k given on them, anything elsewhere
            junk = th.clone()
            junk[[r for r in range(ctx.n_blocks) if r not in rows]] = 1e30
            op.add(ExpertInput(k, params[k], rows, False, base=base.numpy(), theta=junk.numpy()))
        else:
            op.add(ExpertInput(k, params[k], range(ctx.n_blocks), True, base=base.numpy(), theta=th.numpy()))
    return torch.from_numpy(op.finish().copy())


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- full selection against the formulas --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_model_stock(shape) -> None:
    for k, fw in ((2, False), (3, False), (4, True), (3, True)):
        base, th = data(shape, k, 1 + k)
        assert rel(stream("model_stock", base, th, filter_wise=fw), ref_model_stock(base, th, fw)) <= 1e-6


@pytest.mark.parametrize("shape", SHAPES)
def test_nuslerp(shape) -> None:
    for i, (w, flat, rw) in enumerate((([0.3, 0.7], True, False), ([1.0, 2.0], False, False),
                                       ([0.4, 0.6], False, True), ([1.0, -1.0], True, False))):
        base, th = data(shape, 2, 10 + i)
        got = stream("nuslerp", base, th, w, nuslerp_flatten=flat, nuslerp_row_wise=rw)
        assert rel(got, ref_nuslerp(base, th, w, flat, rw)) <= 1e-6


@pytest.mark.parametrize("shape", SHAPES)
def test_multislerp(shape) -> None:
    for i, (w, norm) in enumerate((([0.2, 0.3, 0.5], True), ([1.0, 0.5], False), ([0.5, 1.0, 0.25, 2.0], False),
                                   ([1.0], True))):
        base, th = data(shape, len(w), 20 + i)
        got = stream("multislerp", base, th, w, normalize_weights=norm)
        assert rel(got, ref_multislerp(base, th, w, norm)) <= 1e-6


@pytest.mark.parametrize("shape", SHAPES)
def test_karcher(shape) -> None:
    for i, (k, mi, tol) in enumerate(((1, 10, 1e-5), (3, 10, 1e-5), (2, 2, 1e-3))):
        base, th = data(shape, k, 30 + i)
        got = stream("karcher", base, th, max_iter=mi, tol=tol)
        assert rel(got, ref_karcher(th + [base], mi, tol)) <= 1e-6


def _karcher_inputs(n, k, seed, scales):
    """k experts θ₀ + noise·scale (the scales cycled), then θ₀, flat float32."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n).astype(np.float32)
    return [base + (rng.standard_normal(n) * scales[i % len(scales)]).astype(np.float32) for i in range(k)] + [base]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13])
def test_karcher_full_read_is_the_torch_loop_bit_for_bit(k) -> None:
    """`karcher_float32` (torch's dots and norms, fused float32 kernels for the rest) equals the plain torch loop
    bit for bit, across input counts (the kernel's passes of 8, 4 and 1 inputs), one iteration or several, all
    of max_iter without converging (float32 noise, tol 1e-7) with angles below tol skipped in some iterations,
    some inputs always skipped (tol 0.3), max_iter 0 and tol 0; it does not write its inputs, or writes only
    those it owns."""
    for n, scales, mi, tol in ((4099, [1e-3], 10, 1e-5), (1000, [0.3], 10, 1e-5), (37, [0.5], 3, 0.0),
                               (513, [0.3], 0, 1e-5), (2048, [0.05, 0.6, 0.1, 0.9], 10, 0.3),
                               (5000, [1e-3], 10, 1e-7)):
        xs = _karcher_inputs(n, k, 100 + k, scales)
        keep = [x.copy() for x in xs]
        want = torch_karcher_float32(xs, mi, tol)
        got = karcher_float32(xs, mi, tol)
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, tol)
        assert all(np.array_equal(x, y) for x, y in zip(xs, keep))
        owned = [x.copy() for x in xs[:-1]] + [xs[-1]]
        got = karcher_float32(owned, mi, tol, [True] * k + [False])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(xs[-1], keep[-1])


def test_karcher_full_read_in_chunks_bit_for_bit() -> None:
    """Tensors long enough that the element-wise kernels run in several chunks on numba's threads (the last one
    ragged), nine inputs (a pass of eight and one of one), several iterations: the torch loop's bits."""
    xs = _karcher_inputs(3 * (1 << 17) + 4097, 8, 5, [1e-3, 0.2])
    want = torch_karcher_float32(xs, 10, 1e-7)
    got = karcher_float32(xs, 10, 1e-7)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_karcher_full_read_is_the_one_thread_loop() -> None:
    """karcher's reductions are torch's on one thread (MergeKit's loop on one thread), whatever the caller's
    torch thread count, which is restored after: on long vectors, where a norm's or a dot's sum order depends on
    the thread count (MKL's dots; inputs far apart, so the dots are away from 1 and their roundings show), the result is
    the one-thread torch loop's bits. Long vectors' dots run on a pool of single-threaded workers; short ones
    in the calling thread, after numba's kernels have reset its OpenMP thread count, which torch reads."""
    threads = torch.get_num_threads()
    for n in (1 << 15, (1 << 21) + 4097):  # dots in the calling thread, and on the pool
        xs = _karcher_inputs(n, 8, 11, [1.0, 3.0])
        want = torch_karcher_float32(xs, 10, 1e-7)
        try:
            torch.set_num_threads(2)
            got = karcher_float32(xs, 10, 1e-7)
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(threads)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n


def test_karcher_full_read_edge_cases_bit_for_bit() -> None:
    """Shapes kept; an input given twice (an omitted expert is the base again), owned or not; a zero input
    (left out); inputs whose mean is 0 (the loop starts from the first); every input below tol (zeros)."""
    xs = _karcher_inputs(300 * 7, 4, 7, [0.1])
    shaped = [x.reshape(300, 7) for x in xs]
    want = torch_karcher_float32(shaped, 10, 1e-5)
    got = karcher_float32(shaped, 10, 1e-5)
    assert got.shape == (300, 7) and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    base = xs[-1]
    keep = base.copy()
    for owned in (None, [False, True, False, False, False]):
        ins = [xs[0].copy(), base, xs[2].copy(), base, base]
        got = karcher_float32(ins, 10, 1e-5, owned)
        want = torch_karcher_float32([xs[0], keep, xs[2], keep, keep], 10, 1e-5)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)) and np.array_equal(base, keep)
    zero = np.zeros_like(base)
    for ins in ([xs[0], zero, xs[1], base], [xs[0], -xs[0]], [xs[1], -xs[1], xs[2]], [zero, zero]):
        want = torch_karcher_float32(ins, 10, 1e-5)
        got = karcher_float32(ins, 10, 1e-5)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_omitted_expert_tensor_is_the_base() -> None:
    """An (expert, tensor) not selected has Δ_k = 0: the same as merging with θ_k = θ₀."""
    base, th = data((13, 5), 3, 40)
    for method, kw in (("model_stock", {}), ("multislerp", {}), ("karcher", {})):
        w = [0.2, 0.3, 0.5] if method == "multislerp" else None
        got = stream(method, base, th, w, selected={0, 2}, **kw)
        want = stream(method, base, [th[0], base.clone(), th[2]], w, **kw)
        assert torch.equal(got, want), method
        assert rel(got, stream(method, base, th, w, **kw)) > 1e-4


def test_row_local_modes_on_selected_rows() -> None:
    """model_stock filter_wise and nuslerp per row are planned by block rows of all experts together: on the
    rows read the result is the formula's, on the others θ₀ (their Δ are 0)."""
    from mergepipe_db.operators import operator_class

    base, th = data((40, 9), 3, 60)
    rows = [0, 1, 2, 7, 8, 20, 39]
    part = [base.clone() for _ in th]
    for p, t in zip(part, th):
        p[rows] = t[rows]
    for method, kw, w, ths, ps in (("model_stock", {"filter_wise": True}, None, th, part),
                                   ("nuslerp", {"nuslerp_flatten": False}, [0.3, 0.7], th[:2], part[:2])):
        op = make_operator(method, [ExpertParams(str(k), weight=1.0 if w is None else w[k]) for k in range(len(ths))],
                           options=kw)
        assert not op.tensor_granular and op.joint_election and operator_class(method).tensor_granular
        got = stream(method, base, ths, w, rows=rows, **kw)
        want = ref_model_stock(base, ps, True) if method == "model_stock" else ref_nuslerp(base, ps, w, False)
        assert rel(got, want) <= 1e-6
        rest = [r for r in range(40) if r not in rows]
        assert torch.equal(got[rest], base[rest])


# --- the Gram form ---------------------------------------------------------------------------------------


def _combine(base, thetas, a0, c):
    out = base.double() * float(a0)
    for ck, th in zip(c, thetas):
        out = out + (th.double() - base.double()) * float(ck)
    return out.float()


def test_coefficients_from_gram_equal_the_formulas() -> None:
    """The coefficient functions (what a planner evaluates from catalog statistics) give the formulas'
    outputs when their Gram matrix is exact."""
    base, th = data((64, 33), 3, 50)
    vecs = [base.numpy().reshape(1, -1)] + [(t - base).numpy().reshape(1, -1) for t in th]
    g = gram(vecs)
    a0, c = model_stock_coefficients(g)
    assert rel(_combine(base, th, a0[0], c[0]), ref_model_stock(base, th)) <= 1e-6
    a0, c = nuslerp_coefficients(gram(vecs[:3]), 0.7)
    assert rel(_combine(base, th[:2], a0[0], c[0]), ref_nuslerp(base, th[:2], [0.3, 0.7])) <= 1e-6
    w = np.array([0.2, 0.3, 0.5])
    a0, c1 = multislerp_coefficients(g[0], w, 1e-8)
    assert rel(_combine(base, th, a0, c1), ref_multislerp(base, th, list(w))) <= 1e-6
    a0, c1 = karcher_coefficients(g[0], 10, 1e-5)
    assert rel(_combine(base, th, a0, c1), ref_karcher(th + [base])) <= 1e-6


def ref_slerp_weights(theta0: np.ndarray, theta1: np.ndarray, t: float) -> tuple[float, float]:
    """slerp's weights (s0, s1) of θ₀ and θ_1, written plainly (numpy float64) from MergeKit 0.1.5's formula."""
    a, b = theta0.reshape(-1).astype(np.float64), theta1.reshape(-1).astype(np.float64)
    n0, n1 = float(np.sqrt(a @ a)), float(np.sqrt(b @ b))
    dot = float(a @ b) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
    if abs(dot) > 0.9995:
        return 1.0 - t, t
    th = math.acos(dot)
    return math.sin(th - th * t) / math.sin(th), math.sin(th * t) / math.sin(th)


def test_slerp_coefficients_from_gram_are_the_plain_weights() -> None:
    """(a₀, c₁) from the Gram matrix of [θ₀, Δ] (what the planner evaluates from ‖θ₀‖², ⟨θ₀, Δ⟩, ‖Δ‖²) are
    (s0 + s1, s1) of the plain formula on the tensors, in both branches (lerp near colinear, sines else)."""
    branches = set()
    for shape, scale, t in (((64, 33), 0.005, 0.3), ((64, 33), 0.4, 0.3), ((300, 40), 1.5, 0.8), ((7,), 0.9, 0.5),
                            ((13, 5), 3.0, 0.0), ((13, 5), 3.0, 1.0)):
        base, th = data(shape, 1, 70 + len(shape), scale)
        b, d = base.numpy(), (th[0] - base).numpy()
        a0, c = slerp_coefficients(gram([b.reshape(1, -1), d.reshape(1, -1)])[0], t)
        s0, s1 = ref_slerp_weights(b, th[0].numpy(), t)
        assert a0 == pytest.approx(s0 + s1, rel=1e-9, abs=1e-12) and c.tolist() == pytest.approx([s1], abs=1e-9)
        branches.add(s0 + s1 == pytest.approx(1.0, abs=1e-12))
    assert branches == {True, False}
    zero = np.zeros((4, 3), np.float32)  # θ₀ = 0 and Δ = 0: norms below 1e-8 divide by 1 (dot = 0: sines)
    a0, c = slerp_coefficients(gram([zero.reshape(1, -1), None])[0], 0.25)
    assert [a0, *c.tolist()] == pytest.approx([math.sin(math.pi / 2 * 0.75) + math.sin(math.pi / 2 * 0.25),
                                               math.sin(math.pi / 2 * 0.25)])


def _slerp_stream(base, theta, t, table, rows=None):
    """slerp of one tensor (one block per row) with the plan's coefficient table; `rows`: the blocks read
    (θ_1 given there, the base elsewhere, as the executor gives it), None: all of them."""
    p = ExpertParams("0")
    op = make_operator("slerp", [p], t=t)
    op.use_coefficients(table)
    ctx = TensorContext("w", tuple(base.shape), 1, base.shape[0], seed=0)
    op.begin(base.numpy(), ctx)
    if rows is None:
        op.add(ExpertInput(0, p, range(ctx.n_blocks), True, base=base.numpy(), theta=theta.numpy()))
    elif rows:
        part = base.clone()
        part[rows] = theta[rows]
        op.add(ExpertInput(0, p, rows, False, base=base.numpy(), theta=part.numpy()))
    else:
        op.add(ExpertInput(0, p, (), False, base=base.numpy()))
    return torch.from_numpy(op.finish().copy())


def test_slerp_read_in_part_uses_the_plan_coefficients() -> None:
    """A tensor read in part is θ₀·a₀ + Δ̃·c₁ with the plan's coefficients (Δ̃: Δ on the rows read, 0 elsewhere;
    float32, computed here); read whole it is the exact slerp of the tensors (bit for bit the plain torch formula),
    also when the plan has coefficients for it; a tensor without coefficients keeps the whole-tensor rule."""
    base, th = data((40, 9), 1, 80, 1.2)
    theta = th[0]
    t = 0.35
    s0, s1 = ref_slerp_weights(base.numpy(), theta.numpy(), t)
    assert abs(s0 + s1 - 1.0) > 1e-3  # the sine branch
    table = {"w": [s0 + s1, [s1]]}
    rows = [0, 3, 4, 5, 17, 39]
    keep = torch.zeros(40, 1, dtype=torch.bool)
    keep[rows] = True
    d = torch.where(keep, theta - base, torch.zeros_like(base))
    want = base * torch.tensor(s0 + s1, dtype=torch.float32) + d * torch.tensor(s1, dtype=torch.float32)
    got = _slerp_stream(base, theta, t, table, rows)
    assert rel(got, want) <= 1e-6
    assert rel(got, base * (s0 + s1) + (theta - base) * s1) > 1e-2  # not the full merge
    # nothing read: θ₀·a₀
    assert rel(_slerp_stream(base, theta, t, table, []), base * (s0 + s1)) <= 1e-7
    # read whole: MergeKit's slerp of the tensors, exactly
    v0, v1 = base.reshape(-1).double(), theta.reshape(-1).double()
    n0, n1 = float(torch.linalg.vector_norm(v0)), float(torch.linalg.vector_norm(v1))
    th0 = math.acos(float(torch.dot(v0, v1)) / (n0 * n1))
    exact = base * (math.sin(th0 - th0 * t) / math.sin(th0)) + theta * (math.sin(th0 * t) / math.sin(th0))
    assert torch.equal(_slerp_stream(base, theta, t, table), exact)
    # no coefficients for this tensor (statistics missing): θ_1 with the base's rows where not read, whole-tensor
    part = base.clone()
    part[rows] = theta[rows]
    v1 = part.reshape(-1).double()
    dot = float(torch.dot(v0, v1)) / (n0 * float(torch.linalg.vector_norm(v1)))
    a = math.acos(dot)
    p0, p1 = (1 - t, t) if abs(dot) > 0.9995 else (math.sin(a - a * t) / math.sin(a), math.sin(a * t) / math.sin(a))
    assert rel(_slerp_stream(base, theta, t, {"other": [1.0, [0.5]]}, rows), base * p0 + part * p1) <= 1e-6


def test_gram_is_float64_inner_products() -> None:
    rng = np.random.default_rng(0)
    vs = [rng.standard_normal((3, 50)).astype(np.float32) for _ in range(3)]
    g = gram([vs[0], None, vs[1], vs[2]])
    for i, a in enumerate([vs[0], None, vs[1], vs[2]]):
        for j, b in enumerate([vs[0], None, vs[1], vs[2]]):
            want = np.zeros(3) if a is None or b is None else (a.astype(np.float64) * b).sum(1)
            assert np.allclose(g[:, i, j], want, rtol=1e-12, atol=0)


# --- parameters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "k", "options", "match"), [
    ("model_stock", 1, {}, "at least three models including the base"),
    ("nuslerp", 1, {}, "exactly two models besides the base"),
    ("nuslerp", 3, {}, "exactly two models besides the base"),
    ("model_stock", 2, {"filter_wise": "yes"}, "parameter filter_wise must be true or false"),
    ("nuslerp", 2, {"nuslerp_flatten": 1}, "parameter nuslerp_flatten must be true or false"),
    ("nuslerp", 2, {"nuslerp_row_wise": None}, "parameter nuslerp_row_wise must be true or false"),
    ("multislerp", 2, {"eps": -1.0}, "parameter eps must be a finite number >= 0"),
    ("karcher", 2, {"max_iter": 2.5}, "parameter max_iter must be an integer >= 0"),
    ("karcher", 2, {"tol": math.nan}, "parameter tol must be a finite number >= 0"),
    ("karcher", 2, {"filter_wise": True}, "unknown parameter 'filter_wise'"),
    ("model_stock", 2, {"max_iter": 3}, "unknown parameter 'max_iter'"),
])
def test_bad_parameters_are_named(method, k, options, match) -> None:
    with pytest.raises(SpecError, match=match) as e:
        make_operator(method, [ExpertParams(str(i)) for i in range(k)], options=options)
    assert "\n" not in str(e.value)


def test_multislerp_weights_summing_to_zero() -> None:
    with pytest.raises(SpecError, match="normalize_weights"):
        make_operator("multislerp", [ExpertParams("a", weight=1.0), ExpertParams("b", weight=-1.0)])
    make_operator("multislerp", [ExpertParams("a", weight=1.0), ExpertParams("b", weight=-1.0)],
                  options={"normalize_weights": False})


@pytest.mark.parametrize("keep_bytes", [0, 3000, 1 << 30])
@pytest.mark.parametrize(("method", "k", "weights", "options"), [
    ("model_stock", 3, None, {}), ("nuslerp", 2, [0.3, 0.7], {}), ("multislerp", 3, [0.2, 0.5, 0.3], {}),
    ("karcher", 2, None, {}), ("slerp", 1, None, {"t": 0.4})])
def test_stored_values_kept_or_copied_give_the_same_bits(monkeypatch, keep_bytes, method, k, weights,
                                                        options) -> None:
    """A geometric operator keeps its inputs' stored values (BF16 bits) for its passes while they fit
    `geometric.KEEP_BYTES`, else copies each Δ_k to float32: every mix gives the bits of θ_k handed over as
    float32, including an expert read on some rows only (Δ = 0 on the others, their bytes junk)."""
    from mergepipe_db.operators import geometric

    monkeypatch.setattr(geometric, "KEEP_BYTES", keep_bytes)
    shape = (48, 40)
    base, thetas = data(shape, k, 11)
    base = base.to(torch.bfloat16).float()
    bits = [th.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) for th in thetas]
    params = [ExpertParams(str(i), weight=1.0 if weights is None else weights[i]) for i in range(k)]
    options = dict(options)
    t = options.pop("t", None)
    ctx = TensorContext("t", shape, 4, 12, seed=0)
    for rows in (None, (0, 3, 4, 9)):
        outs = []
        for supply in ("raw", "theta"):
            op = make_operator(method, params, t=t, options=options)
            op.begin(base.numpy(), ctx)
            for i, raw in enumerate(bits):
                sel = range(ctx.n_blocks) if rows is None or i else rows
                theta = (torch.from_numpy(raw.astype(np.int32) << 16).view(torch.float32)).clone()
                if rows is not None and not i:
                    for b in range(ctx.n_blocks):
                        if b not in rows:
                            theta[4 * b:4 * b + 4] = base[4 * b:4 * b + 4]
                if supply == "raw":
                    junk = raw.copy()
                    if rows is not None and not i:
                        junk[[r for r in range(48) if r // 4 not in rows]] = 0x7FC0  # never read
                    x = ExpertInput.from_raw(i, params[i], sel, rows is None or bool(i), base=base.numpy(),
                                             raw=junk, ctx=ctx)
                else:
                    x = ExpertInput(i, params[i], sel, rows is None or bool(i), base=base.numpy(),
                                    theta=theta.numpy())
                op.add(x)
            outs.append(op.finish().copy())
        assert outs[0].tobytes() == outs[1].tobytes(), (method, rows)
        assert np.isfinite(outs[0]).all()
