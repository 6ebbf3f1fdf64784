"""ram and ramplus_tl, Reinforced Agent Merging (docs/SEMANTICS.md): an element's update is averaged over the
experts that change it by more than ε, and kept whole where one expert alone does; ramplus_tl scales each
expert's unique updates by 1 + r·min(max(ρ_k, 0), α), ρ_k its shared/unique count ratio over the tensor.

Under a partial selection an omitted row has every Δ_k = 0, so its value is θ₀ + 0.0, and it adds to
ramplus_tl's counts only when ε < 0 (|0| > ε: every expert counts it, shared when K > 1, unique when K = 1). From
the experts' stored values (`_combine_raw`) the formula runs on the whole tensor, a tile no expert read giving
Δ_k = +0.0: those bytes (`GatherFold.raw_covers_partial`). From gathered float32 values it runs on the rows read
only (compacted, `GatherFold.compacts_rows`) and writes θ₀ + 0.0 on the others."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mergepipe_db.errors import MethodParameterError
from mergepipe_db.operators.base import kernels
from mergepipe_db.operators.gather import GatherFold, gather_kernels
from mergepipe_db.operators.registry import register

__all__ = ["Ram", "RamPlusTL"]


class RamFold(GatherFold):
    """The shared counts: nz_k = |Δ_k| > ε, c = Σ_k nz_k; unique = (c == 1), overlap = (c > 1)."""

    #: an element's count c couples every expert's Δ there: the planner reads block rows of all experts together
    joint_election: ClassVar[bool] = True
    scaled: ClassVar[bool] = False
    compacts_rows = True
    raw_formula = True
    raw_covers_partial = True

    def _combine_raw(self, base: np.ndarray, raws: list[np.ndarray], read: np.ndarray) -> np.ndarray:
        return self._formula(base.reshape(-1), None, 0, (raws, read))

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        rows = self._rows_read()
        if rows is None:
            return self._formula(base.reshape(-1), self._stacked, 0)
        n_rows = self._read.shape[0]
        b2 = base.reshape(n_rows, -1)
        compact = self._compact(values, rows)
        # the omitted elements: |0| > ε counts them for every expert only when ε < 0
        omitted = base.size - compact[0].size if self.params["epsilon"] < 0 else 0
        out = base + np.float32(0.0)  # the formula on Δ_k = 0: c = 0 (or K), every term +0.0
        formula = self._formula(np.take(b2, rows, axis=0).reshape(-1), compact.reshape(len(values), -1), omitted)
        out.reshape(n_rows, -1)[rows] = formula.reshape(b2[:len(rows)].shape)
        return out

    def _formula(self, base: np.ndarray, deltas: np.ndarray | None, omitted: int,
                 stored: tuple[list[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """The formula on θ₀ (flat) and the Δ_k of the same elements (float32 (K, n), or, with `stored`, formed
        from every expert's stored values and their read map); `omitted` elements elsewhere have |Δ_k| > ε for
        every k. A
        numba pass per element (`kernels.gather.ram_combine`): the float32 operations of
        ``θ₀ + Σ_k (z_k·unique·λ_k + (z_k·overlap) / max(c, 1))`` in numpy's order; ramplus_tl's counts come from
        a pass before it, or, from stored values, from the same pass (`kernels.gather.ramplus_raw`)."""
        kern = gather_kernels()
        eps32 = np.float32(self.params["epsilon"])
        packed = kernels().pack(stored[0]) if stored is not None else None
        n_experts = len(stored[0]) if stored is not None else deltas.shape[0]  # type: ignore[union-attr]
        out = np.empty(base.shape, np.float32)
        if self.scaled and packed is not None and n_experts < kern.NOT_UNIQUE:
            # from the stored values: the counts and every element but those one expert alone updates in one
            # pass, then those with their expert's λ_k (the stored values are read once, not twice; an expert's
            # index must fit `ramplus_raw`'s byte code)
            shared = np.zeros(n_experts, np.int64)
            unique = np.zeros(n_experts, np.int64)
            code = self.scratch("ramplus_code", base.size, np.uint8)
            kern.ramplus_raw(out, code, base, packed, stored[1], n_experts, eps32, shared, unique)
            kern.ramplus_unique(out, code, base, self._lambdas(shared, unique, omitted))
            return out
        lam = np.ones(n_experts, np.float32)
        if self.scaled:
            shared = np.zeros(n_experts, np.int64)
            unique = np.zeros(n_experts, np.int64)
            if packed is None:
                kern.ram_counts(deltas, eps32, shared, unique)
            else:
                kern.ram_counts_raw(base, packed, stored[1], n_experts, eps32, shared, unique)
            lam = self._lambdas(shared, unique, omitted)
        if packed is None:
            kern.ram_combine(out, base, deltas, eps32, lam)
        else:
            kern.ram_combine_raw(out, base, packed, stored[1], n_experts, eps32, lam)
        return out

    def _lambdas(self, shared: np.ndarray, unique: np.ndarray, omitted: int) -> np.ndarray:
        """ramplus_tl's λ_k = 1 + r·min(max(ρ_k, 0), α), ρ_k = shared_k / max(unique_k, ε), from the counts over the
        elements formed and the `omitted` ones (float32)."""
        n_experts = shared.shape[0]
        eps = self.params["epsilon"]
        lam = np.ones(n_experts, np.float32)
        for k in range(n_experts):
            sh = int(shared[k]) + (omitted if n_experts > 1 else 0)
            un = int(unique[k]) + (omitted if n_experts == 1 else 0)
            rho = sh / max(float(un), eps)
            lam[k] = 1.0 + self.params["r"] * min(max(rho, 0.0), self.params["alpha"])
        return lam


@register("ram")
class Ram(RamFold):
    """ram (parameter epsilon, default 1e-5)."""

    option_defaults: ClassVar[dict[str, float]] = {"epsilon": 1e-5}


@register("ramplus_tl")
class RamPlusTL(RamFold):
    """ramplus_tl (parameters r = 0.1, alpha = 0.2, epsilon = 1e-5)."""

    option_defaults: ClassVar[dict[str, float]] = {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}
    scaled = True

    def _check(self) -> None:
        # ρ_k = shared_k / max(unique_k, ε): an expert with no unique update would divide by zero (MergeKit's
        # float32 division gives inf or NaN there, a NaN tensor out); refused before anything is read
        if not self.params["epsilon"] > 0:
            raise MethodParameterError(f"{self.name}: parameter epsilon must be > 0 (ρ divides by max(unique "
                                       f"count, epsilon)), got {self.params['epsilon']:g}")
