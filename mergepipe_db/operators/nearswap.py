"""nearswap: take the other model's value where it lies near the base (docs/SEMANTICS.md), elementwise."""

from __future__ import annotations

import numpy as np

from mergepipe_db.errors import MethodParameterError
from mergepipe_db.operators.gather import GatherFold
from mergepipe_db.operators.registry import register

__all__ = ["Nearswap"]


@register("nearswap")
class Nearswap(GatherFold):
    """nearswap with parameter t: w = clamp(t / max(|θ₀ - θ_1|, 1e-6), 0, 1); out = w·θ_1 + (1 - w)·θ₀.
    An omitted block has θ_1 = θ₀ there (out = θ₀ up to the sign of a zero)."""

    gather = "theta"
    uses_theta = True

    def _check(self) -> None:
        if self.n_experts != 1:
            raise MethodParameterError(f"nearswap merges exactly two models, the base and one other; got "
                                       f"{self.n_experts} others")
        if self.t is None:
            raise MethodParameterError("nearswap needs the parameter t")

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        assert self.t is not None
        a, b = base, values[0]
        absdiff = np.abs(a - b)
        w = np.float32(self.t) / np.maximum(absdiff, np.float32(1e-6))
        np.clip(w, np.float32(0), np.float32(1), out=w)
        return w * b + (np.float32(1) - w) * a
