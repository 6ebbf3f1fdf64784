"""The geometric (Gram) family: slerp, model_stock, nuslerp, multislerp and karcher (MergeKit 0.1.5's methods).

Each of them is, per tensor (or per row for model_stock's ``filter_wise`` and nuslerp without
``nuslerp_flatten``), a linear combination ``out = a₀·θ₀ + Σ_k c_k·Δ_k`` whose coefficients are a function
of the Gram matrix ``G`` of the vectors ``[θ₀, Δ_1, …, Δ_K]`` alone (inner products in float64; `gram`). The
coefficient functions (`slerp_coefficients`, `model_stock_coefficients`, `nuslerp_coefficients`,
`multislerp_coefficients`, `karcher_coefficients`) take that matrix, so the same code serves the executor (G
from the tensors read) and a planner that knows G from catalog statistics before reading anything.
docs/SEMANTICS.md states the formulas; at full selection they equal MergeKit's outputs within float32 rounding
(≤ 1e-6 relative). slerp and karcher compute a tensor read whole from the tensors, as MergeKit does, and use
the Gram form only for a tensor read in part.

Without a budget they read whole tensors (`tensor_granular`): an omitted (expert, tensor) means Δ_k = 0 there;
under a budget a plan may read blocks (row-local modes, or coefficients from statistics: `use_coefficients`).
They hold the tensor's inputs in memory (as MergeKit does): per tensor up to `KEEP_BYTES` of stored values as
read, which the per-tensor passes (`kernels.gram`: G in its fixed summation order, then the weighted sum) read
in place, the others as float32 Δ_k; the row and column modes use `gram` (numpy, float64 chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mergepipe_db.errors import SpecError
from mergepipe_db.operators.base import MergeOperator, block_bounds, one_thread_torch_pool, torch_on_one_thread
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.registry import register

__all__ = [
    "Karcher",
    "ModelStock",
    "MultiSlerp",
    "NuSlerp",
    "Slerp",
    "gram",
    "karcher_coefficients",
    "karcher_float32",
    "karcher_mean",
    "karcher_unit",
    "model_stock_coefficients",
    "multislerp_coefficients",
    "nuslerp_coefficients",
    "slerp_coefficients",
    "slerp_weights",
]


def gram(vectors: list[np.ndarray | None]) -> np.ndarray:
    """Gram matrices per group: ``vectors[i]`` is a (groups, n) float32 array, or None for a zero vector;
    returns float64 (groups, m, m) with ``G[g, i, j] = Σ_n v_i[g, n]·v_j[g, n]`` summed in float64, over
    column chunks of ~2^16 elements: each chunk of the present vectors is copied into one float64 (groups, m', w)
    buffer and multiplied by its transpose (one BLAS product for every pair)."""
    present = [i for i, v in enumerate(vectors) if v is not None]
    m = len(vectors)
    if not present:
        return np.zeros((1, m, m), np.float64)
    first = vectors[present[0]]
    assert first is not None
    groups, n = first.shape
    step = max(1, (1 << 16) // max(groups, 1))
    sub = np.zeros((groups, len(present), len(present)), np.float64)
    buf = np.empty((groups, len(present), min(step, max(n, 1))), np.float64)
    for s in range(0, n, step):
        w = min(step, n - s)
        for r, i in enumerate(present):
            buf[:, r, :w] = vectors[i][:, s:s + w]  # type: ignore[index]
        chunk = buf[:, :, :w]
        sub += np.matmul(chunk, chunk.transpose(0, 2, 1))
    upper = np.triu_indices(len(present), 1)
    sub[:, upper[1], upper[0]] = sub[:, upper[0], upper[1]]  # exactly symmetric, whatever the BLAS kernel's order
    g = np.zeros((groups, m, m), np.float64)
    g[:, np.array(present)[:, None], np.array(present)[None, :]] = sub
    return g


def _groups(a: np.ndarray, mode: str) -> np.ndarray:
    """`a` as (groups, n): the whole tensor ("flat"), its rows along the last axis ("rows"; a 1-d tensor is
    one row), or its columns along dim 0 ("cols": every index of dims 1.. is a group)."""
    if mode == "flat" or a.ndim <= 1:
        return a.reshape(1, -1)
    if mode == "rows":
        return a.reshape(-1, a.shape[-1])
    return a.reshape(a.shape[0], -1).T


def _ungroup(g: np.ndarray, shape: tuple[int, ...], mode: str) -> np.ndarray:
    if mode == "cols" and len(shape) > 1:
        return np.ascontiguousarray(g.T).reshape(shape)
    return g.reshape(shape)


# --- coefficient functions (float64, from Gram matrices) ------------------------------------------------


def model_stock_coefficients(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """model_stock: ``(a0, c)`` per group for ``out = a0·θ₀ + Σ c_k Δ_k``; ``g`` is (groups, K+1, K+1)."""
    k = g.shape[1] - 1
    norms = np.sqrt(np.maximum(np.diagonal(g, axis1=1, axis2=2)[:, 1:], 0.0))
    cos = np.zeros(g.shape[0], np.float64)
    pairs = 0
    for i in range(k):
        for j in range(i + 1, k):
            c = g[:, 1 + i, 1 + j] / np.maximum(norms[:, i] * norms[:, j], 1e-6)
            cos = cos + np.clip(c, -1.0, 1.0)
            pairs += 1
    cos = cos / pairs
    den = 1.0 + (k - 1) * cos
    singular = np.abs(den) < 1e-6
    t = np.where(singular, 0.0, (k * cos) / np.where(singular, 1.0, den))
    return np.ones(g.shape[0]), np.repeat((t / k)[:, None], k, axis=1)


def slerp_weights(dot: float, t: float) -> tuple[float, float]:
    """slerp's weights (s0, s1) of θ₀ and θ_1 from the cosine `dot` of the two (Python floats): linear
    interpolation when ``|dot| > 0.9995``, else ``sin((1−t)θ)/sin θ``, ``sin(tθ)/sin θ`` with ``θ = acos(dot)``."""
    if abs(dot) > 0.9995:
        return 1 - t, t
    th0 = math.acos(dot)
    s = math.sin(th0)
    tht = th0 * t
    return math.sin(th0 - tht) / s, math.sin(tht) / s


def slerp_coefficients(g: np.ndarray, t: float) -> tuple[float, np.ndarray]:
    """slerp between θ₀ and θ_1 = θ₀ + Δ as ``(a0, [c1])``: ``s0·θ₀ + s1·θ_1 = (s0 + s1)·θ₀ + s1·Δ``; ``g`` is
    the (2, 2) Gram matrix of [θ₀, Δ], so ``‖θ_1‖² = G00 + 2·G01 + G11`` and ``⟨θ₀, θ_1⟩ = G00 + G01``."""
    b, bd, dd = float(g[0, 0]), float(g[0, 1]), float(g[1, 1])
    n0, n1 = math.sqrt(max(b, 0.0)), math.sqrt(max(b + 2.0 * bd + dd, 0.0))
    s0, s1 = slerp_weights((b + bd) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0)), t)
    return s0 + s1, np.array([s1])


def nuslerp_coefficients(g: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """nuslerp between Δ_1 and Δ_2 (the base given): ``(a0, c)`` per group; ``g`` is (groups, 3, 3)."""
    n0 = np.maximum(np.sqrt(np.maximum(g[:, 1, 1], 0.0)), 1e-7)
    n1 = np.maximum(np.sqrt(np.maximum(g[:, 2, 2], 0.0)), 1e-7)
    cos = np.clip(g[:, 1, 2] / (n0 * n1), -1.0, 1.0)
    colinear = (1.0 - cos * cos) <= 1e-16
    theta = np.arccos(np.where(colinear, 0.0, cos))
    s = np.where(colinear, 1.0, np.sin(theta))
    c0 = np.where(colinear, 1.0 - t, np.sin((1.0 - t) * theta) / s)
    c1 = np.where(colinear, t, np.sin(t * theta) / s)
    return np.ones(g.shape[0]), np.stack([c0, c1], axis=1)


def multislerp_coefficients(g: np.ndarray, weights: np.ndarray, eps: float) -> tuple[float, np.ndarray]:
    """multislerp of the task vectors Δ_k (the base given): ``(a0, c)``; ``g`` is the (K+1, K+1) Gram matrix,
    ``weights`` the (already normalized) weights. SpecError when the weighted mean of the unit vectors is 0
    (MergeKit's ValueError) with more than two experts."""
    gd = g[1:, 1:]
    w = np.asarray(weights, np.float64)
    norms = np.sqrt(np.maximum(np.diagonal(gd), 0.0))
    s = 1.0 / (norms + eps)
    ws = w * s
    mean_norm = math.sqrt(max(float(ws @ gd @ ws), 0.0))
    if mean_norm < eps:
        if len(w) == 2:
            return 1.0, w.copy()
        raise SpecError("multislerp: the weighted sum of the unit task vectors is zero (antipodal models with "
                        "balancing weights); use other weights")
    m = ws / mean_norm
    dots = s * (gd @ m)
    tau = ws - float(w @ dots) * m
    tn = math.sqrt(max(float(tau @ gd @ tau), 0.0)) + eps
    r = m * math.cos(tn) + tau * (math.sin(tn) / tn)
    return 1.0, float(norms @ w) * r


def karcher_coefficients(g: np.ndarray, max_iter: int, tol: float) -> tuple[float, np.ndarray]:
    """karcher over the N = K + 1 models θ₀, θ_1 … θ_K (equal weights 1/N): ``(a0, c)``; ``g`` is the Gram
    matrix of [θ₀, Δ_1 … Δ_K]. The mean is kept as coefficients μ over the θ_i (its inner products from
    ``H = Mᵀ G M``, θ_i = θ₀ + Δ_i)."""
    n = g.shape[0]
    basis = np.eye(n)
    basis[0, 1:] = 1.0  # column i: θ_i in the [θ₀, Δ…] basis
    h = basis.T @ g @ basis
    norms = np.sqrt(np.maximum(np.diagonal(h), 0.0))
    alphas = [1.0 / n] * n
    units = np.diag(np.where(norms == 0.0, 0.0, 1.0 / np.where(norms == 0.0, 1.0, norms)))  # column i: u_i

    def norm(mu: np.ndarray) -> float:
        return math.sqrt(max(float(mu @ h @ mu), 0.0))

    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return 0.0, np.zeros(n - 1)
    total = sum(alphas[i] for i in valid)
    na = [alphas[i] / total for i in valid]
    mean = np.zeros(n)
    for a, i in zip(na, valid):
        mean = mean + a * units[:, i]
    mn = norm(mean)
    mean = units[:, valid[0]].copy() if mn < tol else mean / mn
    for _ in range(max_iter):
        tangent = np.zeros(n)
        for a, i in zip(na, valid):
            u = units[:, i]
            dot = min(1.0, max(-1.0, float(mean @ h @ u)))
            th = math.acos(dot)
            if th < tol:
                continue
            tangent = tangent + a * (th / math.sin(th)) * (u - dot * mean)
        tn = norm(tangent)
        if tn < tol:
            break
        mean = math.cos(tn) * mean + math.sin(tn) * (tangent / tn)
        un = norm(mean)
        if un > tol:
            mean = mean / un
    scale = sum(a * float(x) for a, x in zip(alphas, norms))
    coef = basis @ (scale * mean)  # back to the [θ₀, Δ…] basis
    return float(coef[0]), coef[1:]


# --- the operators ---------------------------------------------------------------------------------------


#: stored bytes of a tensor's inputs a GramFold keeps for its fused passes (`kernels.gram`) instead of copying
#: each Δ_k into float32 (twice their size for BF16); inputs beyond it are copied
KEEP_BYTES = 1 << 30

_KEPT = np.empty(0, np.float32)  # `GramFold._deltas` entry of an input kept in `_stash`


def _gram_kernels():  # noqa: ANN202 - `mergepipe_db.kernels.gram`, imported on first use (numba)
    from mergepipe_db.kernels import gram as gram_kernels

    return gram_kernels


def _flag(value: Any, what: str, method: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{method}: parameter {what} must be true or false, got {value!r}")
    return value


class GramFold(MergeOperator):
    """Holds Δ_k of every expert of a tensor (None where nothing was selected: Δ_k = 0) and combines them with
    coefficients from their Gram matrix at `finish`."""

    tensor_granular = True
    uses_theta = True
    copies_inputs = True  # Δ_k into its own buffer (`_delta_copy`)
    #: how a tensor is grouped for its coefficients ("flat", "rows", "cols")
    _deltas: list[np.ndarray | None]

    #: coefficients from catalog statistics, by tensor name: [a0, [c_1 … c_K]] (`use_coefficients`)
    _planned_coefficients: Any = None

    def group_mode(self) -> str:
        return "flat"

    @property
    def plans_from_gram(self) -> bool:
        """Whether a partial read takes this method's coefficients from catalog statistics (per-tensor
        coefficients: the "flat" mode), so that it can be planned by blocks."""
        return self.group_mode() == "flat"

    def coefficients_from_gram(self, g: np.ndarray) -> tuple[float, list[float]]:
        """(a0, [c_k]) of one tensor from its (K+1, K+1) Gram matrix of [θ₀, Δ_1 … Δ_K] (float64)."""
        a0, c = self._coefficients(np.asarray(g, np.float64))
        return float(np.asarray(a0).reshape(-1)[0]), [float(v) for v in np.asarray(c).reshape(-1)]

    def use_coefficients(self, table: Any) -> None:
        """The plan's coefficients (`coefficients_from_gram` of the catalog's statistics, by tensor name): a tensor
        not read whole for every expert is combined with them; a tensor read whole with its exact Gram matrix."""
        self._planned_coefficients = dict(table or {})

    def _begin(self) -> None:
        self._deltas = []  # per input: its Δ_k (float32), None (Δ_k = 0) or _KEPT (its stored values in _stash)
        self._full: list[bool] = []
        self._stash: list[tuple[np.ndarray, ExpertInput]] = []  # kept inputs' stored values (flat), in input order
        self._stash_bytes = 0

    def _add(self, x: ExpertInput) -> None:
        self._full.append(bool(x.full))
        if not x.selected_blocks:
            self._deltas.append(None)
            return
        src = x.stored_flat()
        if (src is not None and self.group_mode() == "flat" and self._stash_bytes + src.nbytes <= KEEP_BYTES
                and (not self._stash or self._stash[0][0].dtype == src.dtype)):
            self._stash.append((src, x))
            self._stash_bytes += src.nbytes
            self._deltas.append(_KEPT)
        else:
            self._deltas.append(self._delta_copy(x, len(self._deltas)))

    def _delta_copy(self, x: ExpertInput, k: int) -> np.ndarray:
        """Δ_k of the tensor (θ_k − θ₀ in float32 on the selected rows, 0 elsewhere) in this operator's reused
        buffer for input k: from the stored values in one pass where the input holds only those
        (`kernels.gather.gather_delta`, as `GatherFold` fills its rows), else a copy of the input's Δ."""
        from mergepipe_db.kernels.gather import gather_delta

        ctx, base, bflat = self._ctx, self._base, self._bflat
        assert ctx is not None and base is not None and bflat is not None
        out = self.scratch(f"gram_delta{k}", base.size)
        src = x.stored_flat()
        if src is not None:
            gather_delta(out, bflat, src, x.element_ranges_array(ctx))
        else:
            d = x.delta
            assert d is not None
            np.copyto(out, d.reshape(-1), casting="same_kind")
        return out.reshape(base.shape)

    def _planned(self) -> tuple[float, list[float]] | None:
        """The plan's coefficients of this tensor, when it has them and some expert was not read whole."""
        assert self._ctx is not None
        if not self._planned_coefficients or all(self._full) or self._ctx.name not in self._planned_coefficients:
            return None
        a0, c = self._planned_coefficients[self._ctx.name]
        return float(a0), [float(v) for v in c]

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        raise NotImplementedError

    #: whether the coefficients use θ₀'s row of the Gram matrix (nuslerp, multislerp and model_stock use the
    #: Δ_k alone: the fused pass leaves that row 0 and skips its products)
    gram_uses_base = True

    def _finish(self) -> np.ndarray:
        base = self._base
        assert base is not None
        mode = self.group_mode()
        if mode == "flat":
            return self._finish_flat()
        if all(d is None for d in self._deltas):  # no expert read on this tensor: θ₀
            return base.copy()
        vecs = [_groups(base, mode)] + [None if d is None else _groups(d, mode) for d in self._deltas]
        a0s, cs = self._coefficients(gram(vecs))
        b = vecs[0]
        a0f = a0s.astype(np.float32)[:, None]
        out = self.scratch("gram_out", b.size).reshape(b.shape)  # finish() may return a reused buffer
        if np.all(a0s == 1.0):
            np.copyto(out, b)
        else:
            np.multiply(b, a0f, out=out)
        term = self.scratch("gram_term", b.size).reshape(b.shape)
        for k, v in enumerate(vecs[1:]):
            if v is not None:
                out += np.multiply(v, cs[:, k].astype(np.float32)[:, None], out=term)
        return _ungroup(out, base.shape, mode)

    def _finish_flat(self) -> np.ndarray:
        """One tensor's coefficients (the plan's, or from its Gram matrix, `kernels.gram.gram_pass`) and its
        weighted sum (`combine_pass`): two passes over the inputs, kept ones read from their stored values."""
        base, bflat, ctx = self._base, self._bflat, self._ctx
        assert base is not None and bflat is not None and ctx is not None
        planned = self._planned()
        present = [k for k, d in enumerate(self._deltas) if d is not None]
        if planned is None and not present:  # no expert read on this tensor: θ₀
            return base.copy()
        kernels = _gram_kernels()
        bounds = block_bounds(ctx)
        inputs = self._pass_inputs(present, ctx.n_blocks)
        if planned is not None:
            a0, c = planned
        else:
            rows = [0] + [1 + k for k in present]
            g = np.zeros((1 + len(self._deltas),) * 2, np.float64)
            g[np.ix_(rows, rows)] = kernels.gram_pass(bflat, *inputs, bounds, self.gram_uses_base)
            a0, c = self._coefficients(g)
        a0 = float(np.asarray(a0).reshape(-1)[0])
        cs = np.asarray(c, np.float64).reshape(-1)[present].astype(np.float32)
        out = self.scratch("gram_out", base.size)  # finish() may return a reused buffer
        kernels.combine_pass(out, bflat, *inputs, bounds, np.float32(a0), a0 == 1.0, cs)
        return out.reshape(base.shape)

    def _pass_inputs(self, present: list[int], n_blocks: int) -> tuple[Any, ...]:
        """`kernels.gram.pass_inputs` for the inputs `present`: a kept input from its stored values, the others
        from their Δ_k."""
        kernels = _gram_kernels()
        kept = iter(self._stash)
        raws: list[np.ndarray] = []
        vecs: list[np.ndarray] = []
        kinds: list[int] = []
        sources: list[int] = []
        selected = np.zeros((max(len(self._stash), 1), n_blocks), np.bool_)
        for k in present:
            d = self._deltas[k]
            if d is _KEPT:
                src, x = next(kept)
                selected[len(raws), list(x.selected_blocks)] = True
                kinds.append(kernels.FROM_DELTA)
                sources.append(len(raws))
                raws.append(src)
            else:
                assert d is not None
                kinds.append(kernels.FROM_VEC)
                sources.append(len(vecs))
                vecs.append(d.reshape(-1))
        return kernels.pass_inputs(raws, vecs, kinds, sources, selected)

    def _end(self) -> None:
        self._deltas = []
        self._stash = []


@register("slerp")
class Slerp(GramFold):
    """slerp between θ₀ and θ_1 with parameter t. A tensor read whole (or not at all: θ_1 = θ₀) is computed from
    the tensors as MergeKit does (`_finish_read`, float64 norms and dot); one read in part under a budget
    with the plan's coefficients from catalog statistics (`slerp_coefficients`, `GramFold.use_coefficients`)."""

    copies_inputs = True  # keeps the θ_1 input until finish, and says so (`held_inputs`)

    def _validate(self) -> None:
        if self.n_experts != 1:
            raise SpecError(f"slerp merges exactly two models, the base and one other; "
                            f"got {self.n_experts} others")
        if self.t is None:
            raise SpecError("slerp needs the parameter t")
        if not 0.0 <= self.t <= 1.0:
            raise SpecError(f"slerp: t {self.t!r} must be in [0, 1]")

    def coefficient(self, k: int) -> float:
        assert self.t is not None
        return abs(self.t)

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        assert self.t is not None
        return slerp_coefficients(g, self.t)

    def _begin(self) -> None:
        super()._begin()
        self._theta1_input: ExpertInput | None = None

    def _add(self, x: ExpertInput) -> None:
        if self._planned_coefficients and self._ctx is not None and self._ctx.name in self._planned_coefficients:
            super()._add(x)  # Δ, for the planned coefficients if it is read in part
        else:
            self._full.append(bool(x.full))
        self._theta1_input = x if x.selected_blocks else None  # kept until finish (`held_inputs`)

    def held_inputs(self) -> frozenset[int]:
        held = super().held_inputs()
        return held if self._theta1_input is None else held | {self._theta1_input.index}

    def _finish(self) -> np.ndarray:
        if self._planned() is not None:
            return super()._finish()
        return self._finish_read()

    def _finish_read(self) -> np.ndarray:
        """slerp of the tensors themselves: the norms and the dot of θ₀ and θ_1 in float64, summed as
        `kernels.gram` orders them (the definition: the order sets the bits); the sum in float32,
        ``θ₀·s0 + θ_1·s1``. θ_1 comes from its stored values when it was read whole."""
        bflat, ctx, t, x = self._bflat, self._ctx, self.t, self._theta1_input
        assert bflat is not None and ctx is not None and t is not None
        kernels = _gram_kernels()
        src = x.stored_flat() if x is not None and len(x.selected_blocks) == ctx.n_blocks else None
        every_block = np.ones((1, ctx.n_blocks), np.bool_)
        if src is not None:
            inputs = kernels.pass_inputs([src], [], [kernels.FROM_THETA], [0], every_block)
        else:  # θ_1 = θ₀ where the expert was not read
            theta1 = bflat if x is None else np.ascontiguousarray(x.theta, np.float32).reshape(-1)
            inputs = kernels.pass_inputs([], [theta1], [kernels.FROM_VEC], [0], every_block)
        bounds = block_bounds(ctx)
        g = kernels.gram_pass(bflat, *inputs, bounds, True)
        n0, n1 = math.sqrt(g[0, 0]), math.sqrt(g[1, 1])
        c0, c1 = slerp_weights(float(g[0, 1]) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0)), t)
        out = self.scratch("slerp_out", bflat.size)  # finish() may return a reused buffer
        kernels.combine_pass(out, bflat, *inputs, bounds, np.float32(c0), False, np.array([c1], np.float32))
        return out.reshape(ctx.shape)

    def _end(self) -> None:
        super()._end()
        self._theta1_input = None


@register("model_stock")
class ModelStock(GramFold):
    """model_stock (Jang et al.): θ₀ + t·(mean θ_k − θ₀), t from the mean pairwise cosine of the Δ_k; per row
    with ``filter_wise``."""

    option_defaults = {"filter_wise": False}
    gram_uses_base = False

    def _validate(self) -> None:
        if self.n_experts < 2:
            raise SpecError(f"model_stock needs at least three models including the base; got the base and "
                            f"{self.n_experts} other")
        _flag(self.options["filter_wise"], "filter_wise", self.name)
        if self.options["filter_wise"]:  # row-local: plan block rows of all experts together
            self.tensor_granular, self.joint_election = False, True

    def group_mode(self) -> str:
        return "rows" if self.options["filter_wise"] else "flat"

    def coefficient(self, k: int) -> float:
        return 1.0 / self.n_experts

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        if g.ndim == 2:
            a0, c = model_stock_coefficients(g[None])
            return float(a0[0]), c[0]
        return model_stock_coefficients(g)


@register("nuslerp")
class NuSlerp(GramFold):
    """nuslerp between the task vectors of exactly two experts, t = w_2 / (w_1 + w_2) (0.5 when the weights sum
    to ~0); per tensor (``nuslerp_flatten``, default), per row, or per column (``nuslerp_row_wise``)."""

    option_defaults = {"nuslerp_flatten": True, "nuslerp_row_wise": False}
    gram_uses_base = False

    def _validate(self) -> None:
        if self.n_experts != 2:
            raise SpecError(f"nuslerp merges exactly two models besides the base; got {self.n_experts}")
        _flag(self.options["nuslerp_flatten"], "nuslerp_flatten", self.name)
        _flag(self.options["nuslerp_row_wise"], "nuslerp_row_wise", self.name)
        if self.group_mode() == "rows":  # row-local: plan block rows of both experts together
            self.tensor_granular, self.joint_election = False, True
        total = self.weights[0] + self.weights[1]
        self.t_interp = 0.5 if abs(total) < 1e-6 else self.weights[1] / total

    def group_mode(self) -> str:
        if self.options["nuslerp_flatten"]:
            return "flat"
        return "cols" if self.options["nuslerp_row_wise"] else "rows"

    def coefficient(self, k: int) -> float:
        return abs(self.t_interp if k == 1 else 1.0 - self.t_interp)

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        if g.ndim == 2:
            a0, c = nuslerp_coefficients(g[None], self.t_interp)
            return float(a0[0]), c[0]
        return nuslerp_coefficients(g, self.t_interp)


@register("multislerp")
class MultiSlerp(GramFold):
    """multislerp: barycentric interpolation of the task vectors on the hypersphere (weights required)."""

    option_defaults = {"normalize_weights": True, "eps": 1e-8}
    gram_uses_base = False
    _theta1: np.ndarray | None = None

    def _validate(self) -> None:
        _flag(self.options["normalize_weights"], "normalize_weights", self.name)
        eps = self.options["eps"]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise SpecError(f"multislerp: parameter eps must be a finite number >= 0, got {eps!r}")
        w = np.array(self.weights, np.float32)
        if self.options["normalize_weights"]:
            if float(w.sum()) == 0.0:
                raise SpecError("multislerp: the weights sum to 0, so parameter normalize_weights cannot "
                                "normalize them")
            w = w / w.sum()
        self.norm_weights = w.astype(np.float64)

    def coefficient(self, k: int) -> float:
        return abs(float(self.norm_weights[k]))

    def _add(self, x: ExpertInput) -> None:
        super()._add(x)
        if self.n_experts == 1:  # MergeKit returns the one model's tensor itself
            self._theta1 = None if not x.selected_blocks else np.array(x.theta, dtype=np.float32, copy=True)

    @property
    def plans_from_gram(self) -> bool:
        return self.n_experts > 1

    def _finish(self) -> np.ndarray:
        if self.n_experts == 1:
            assert self._base is not None
            return self._base.copy() if self._theta1 is None else self._theta1
        return super()._finish()

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        return multislerp_coefficients(g, self.norm_weights, float(self.options["eps"]))


@register("karcher")
class Karcher(GramFold):
    """karcher: the Karcher (Riemannian) mean on the hypersphere of the base and the experts, equal weights,
    rescaled by their mean norm."""

    option_defaults = {"max_iter": 10, "tol": 1e-5}
    uses_torch = True

    def _validate(self) -> None:
        mi = self.options["max_iter"]
        if isinstance(mi, bool) or not isinstance(mi, int) or mi < 0:
            raise SpecError(f"karcher: parameter max_iter must be an integer >= 0, got {mi!r}")
        tol = self.options["tol"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
            raise SpecError(f"karcher: parameter tol must be a finite number >= 0, got {tol!r}")

    def coefficient(self, k: int) -> float:
        return 1.0 / (self.n_experts + 1)

    def _coefficients(self, g: np.ndarray) -> tuple[Any, np.ndarray]:
        return karcher_coefficients(g, int(self.options["max_iter"]), float(self.options["tol"]))

    def _finish(self) -> np.ndarray:
        if self._planned() is not None:
            return super()._finish()
        return self._finish_read()

    def _finish_read(self) -> np.ndarray:
        """Full read: the iteration on the tensors themselves in float32 (`karcher_mean`): near the base the
        angles are ~1e-4 and float32 rounding of ``cos θ`` moves them by ~1e-4 relative, which MergeKit's
        result carries; the Gram form (`karcher_coefficients`, exact in float64) differs from it by that much."""
        base = self._base
        assert base is not None
        tol = float(self.options["tol"])
        for k, theta in enumerate(self._thetas):  # the inputs whose units `_add` left for here
            if theta is not None and self._units[k] is None:
                self._units[k] = karcher_unit(theta, theta, tol)
        base_unit = self._base_unit()
        pairs = [base_unit if u is None else u for u in self._units] + [base_unit]  # MergeKit's order: base last
        out = karcher_mean(pairs, base.size, int(self.options["max_iter"]), tol, self.scratch)
        return out.reshape(base.shape)

    def _base_unit(self) -> tuple[Any, np.ndarray | None]:
        """θ₀'s norm and unit vector (in a buffer of this operator's; θ₀ itself is not written), once a tensor."""
        if self._base_nu is None:
            assert self._bflat is not None
            out = self.scratch("karcher_base", self._bflat.size)
            self._base_nu = karcher_unit(self._bflat, out, float(self.options["tol"]))
        return self._base_nu

    def _begin(self) -> None:
        super()._begin()
        #: per input, its θ_k (a buffer of this operator's) or None (θ_k = θ₀), and its (norm, unit) or None
        #: (θ₀'s, or left for `_finish_read`)
        self._thetas: list[np.ndarray | None] = []
        self._units: list[tuple[Any, np.ndarray | None] | None] = []
        self._base_nu: tuple[Any, np.ndarray | None] | None = None
        #: whether each unit vector is made as its expert arrives: not where the plan may combine the tensor with
        #: its coefficients from statistics (`GramFold._planned`), which need no unit vectors
        self._eager = not (self._planned_coefficients and self._ctx is not None
                           and self._ctx.name in self._planned_coefficients)
        if self._eager:  # θ₀'s unit while the experts are read
            self._base_unit()

    def _add(self, x: ExpertInput) -> None:
        if not self._eager:
            super()._add(x)  # Δ_k, for the planned coefficients if some expert is read in part
        else:
            self._full.append(bool(x.full))
        theta = self._theta_copy(x, len(self._thetas)) if x.selected_blocks else None
        self._thetas.append(theta)
        # each unit vector as its expert arrives, while the next is read (the planned path may not need it)
        self._units.append(karcher_unit(theta, theta, float(self.options["tol"]))
                           if theta is not None and self._eager else None)

    def _theta_copy(self, x: ExpertInput, k: int) -> np.ndarray:
        """θ_k (flat float32) in this operator's reused buffer for input k: widened from the stored values in
        one pass on numba's threads when every block was read, else copied from the input's θ_k."""
        from mergepipe_db.kernels.merge import widen_into_par

        assert self._ctx is not None and self._bflat is not None
        out = self.scratch(f"karcher{k}", self._bflat.size)
        src = x.stored_flat()
        if src is not None and len(x.selected_blocks) == self._ctx.n_blocks:
            widen_into_par(out, src)
        else:
            theta = x.theta
            assert theta is not None
            np.copyto(out, theta.reshape(-1), casting="same_kind")
        return out

    def _end(self) -> None:
        super()._end()
        self._thetas, self._units, self._base_nu = [], [], None


def karcher_unit(t: np.ndarray, out: np.ndarray, tol: float) -> tuple[Any, np.ndarray | None]:
    """``(‖t‖, t / ‖t‖)`` of flat float32 `t` (the norm a 0-d torch tensor, torch's; the division into `out`,
    which may be `t`), or ``(‖t‖, None)`` when ‖t‖ <= tol: karcher leaves such an input out (`out` unwritten)."""
    import torch

    from mergepipe_db.kernels.karcher import divide, in_place

    nrm = torch.linalg.vector_norm(torch.from_numpy(t))
    if not float(nrm) > tol:
        return nrm, None
    if out is t:
        in_place(t, np.float32(nrm.item()), True)
    else:
        divide(out, t, np.float32(nrm.item()))
    return nrm, out


def karcher_float32(tensors: list[np.ndarray], max_iter: int, tol: float,
                    owned: Sequence[bool] | None = None) -> np.ndarray:
    """The weighted (1/N) Karcher mean of float32 tensors on the hypersphere, every step a float32 operation of
    torch's, as docs/SEMANTICS.md writes it (`karcher_unit` for each input, then `karcher_mean`), so the result
    is torch's bit for bit.

    ``owned[i]``: ``tensors[i]`` (float32, contiguous) may be overwritten, with its unit vector; the others are
    not written. An array given more than once is divided once."""
    n = len(tensors)
    flats = [np.ascontiguousarray(t, dtype=np.float32).reshape(-1) for t in tensors]
    done: dict[int, tuple[Any, np.ndarray | None]] = {}  # by id of the input array: its (norm, unit)
    pairs = []
    for i in range(n):
        if id(tensors[i]) not in done:
            writable = owned is not None and all(owned[j] for j in range(n) if tensors[j] is tensors[i])
            in_place = writable or not np.may_share_memory(flats[i], tensors[i])  # else flats[i] is our copy
            done[id(tensors[i])] = karcher_unit(flats[i], flats[i] if in_place else np.empty_like(flats[i]), tol)
        pairs.append(done[id(tensors[i])])
    out = karcher_mean(pairs, flats[0].size, max_iter, tol)
    return out.reshape(np.shape(tensors[0]))


def karcher_mean(inputs: list[tuple[Any, np.ndarray | None]], size: int, max_iter: int, tol: float,
                 buffer: Any = None) -> np.ndarray:
    """karcher's loop (`_karcher_loop`) on its N inputs' ``(norm, unit vector)``, as `karcher_unit` gives them, its
    dots on one thread (`_dots`); the caller's torch thread count is restored after."""
    import torch

    prev = torch.get_num_threads()
    try:
        return _karcher_loop([u for _, u in inputs], [nrm for nrm, _ in inputs], size, max_iter, tol, buffer)
    finally:
        torch.set_num_threads(prev)


def _karcher_loop(units: list[np.ndarray | None], norms: list[Any], size: int, max_iter: int, tol: float,
                  buffer: Any = None) -> np.ndarray:
    """karcher's loop from its N inputs' unit vectors (flat float32 of `size` elements; None for an input left
    out, its norm <= tol; every input left out gives zeros) and norms (0-d float32 torch tensors,
    `karcher_unit`), weights 1/N: the start at the normalized mean, up to `max_iter` tangent steps, the mean
    norm's rescale. The dots (on one thread) and norms are torch's; the element-wise steps fused kernels doing the
    same float32 operations in the same order (`kernels.karcher`). The result is flat, in
    ``buffer("karcher_mean", size)`` when `buffer` is given (as `MergeOperator.scratch`), which also gives the
    tangent's."""
    import torch

    from mergepipe_db.kernels.karcher import in_place, karcher_step, karcher_tangent
    from mergepipe_db.kernels.merge import pack

    get = buffer if buffer is not None else (lambda _name, m: np.empty(m, np.float32))
    n = len(units)
    alphas = [1.0 / n] * n
    valid = [i for i in range(n) if units[i] is not None]
    if not valid:
        out = get("karcher_mean", size)
        out[:] = 0.0
        return out
    total = sum(alphas[i] for i in valid)
    na = [alphas[i] / total for i in valid]
    vu = pack([units[i] for i in valid])  # type: ignore[misc]
    count = len(valid)
    vt = [torch.from_numpy(u) for u in vu[:count]]
    mean_np, tangent_np = get("karcher_mean", size), get("karcher_tangent", size)
    picks = np.arange(count, dtype=np.int64)  # then: the inputs whose angle to the mean is at least tol, in order
    dots = np.zeros(count, np.float32)
    karcher_tangent(mean_np, mean_np, vu, picks, dots, np.array(na, np.float32), count, False)  # Σ a·u from +0.0
    mean = torch.from_numpy(mean_np)
    mn = torch.linalg.vector_norm(mean)
    if float(mn) < tol:
        np.copyto(mean_np, vu[0])
    else:
        in_place(mean_np, np.float32(mn.item()), True)
    tangent = torch.from_numpy(tangent_np)
    coefs = np.empty(count, np.float32)
    for _ in range(max_iter):
        terms = 0
        for j, (a, raw_dot) in enumerate(zip(na, _dots(mean, vt))):
            dot = torch.clamp(raw_dot, -1.0, 1.0)
            th = torch.arccos(dot)
            if float(th) < tol:
                continue
            picks[terms], dots[terms], coefs[terms] = j, dot.item(), (a * (th / torch.sin(th))).item()
            terms += 1
        karcher_tangent(tangent_np, mean_np, vu, picks, dots, coefs, terms, True)
        tn = torch.linalg.vector_norm(tangent)
        if float(tn) < tol:
            break
        karcher_step(mean_np, tangent_np, np.float32(torch.cos(tn).item()), np.float32(torch.sin(tn).item()),
                     np.float32(tn.item()))
        un = torch.linalg.vector_norm(mean)
        if float(un) > tol:
            in_place(mean_np, np.float32(un.item()), True)
    factor = sum(a * nm for a, nm in zip(alphas, norms))  # a 0-d float32 tensor, in input order
    in_place(mean_np, np.float32(factor.item()), False)
    return mean_np


_DOT_POOL_FROM = 1 << 20  # elements from which the dots run on the pool (below, a thread hand-off costs more)


def _dots(mean: Any, vt: list[Any]) -> list[Any]:
    """``[torch.dot(mean, u) for u in vt]`` with torch on one thread: for long vectors on a pool of
    single-threaded torch workers, two or more at once (memory-bound, they gain from a second core), the same
    bits; else in the calling thread."""
    import torch

    if len(vt) < 2 or mean.numel() < _DOT_POOL_FROM:
        # torch on one thread here: MergeKit's loop runs on one, and `torch.dot` goes to MKL, whose sum order
        # depends on the thread count (torch's own norms' does not). numba's OpenMP kernels set the calling
        # thread's OpenMP count, which torch reads, to numba's, so this is set just before the dots
        torch_on_one_thread()
        return [torch.dot(mean, u) for u in vt]
    return list(one_thread_torch_pool().map(lambda u: torch.dot(mean, u), vt))
