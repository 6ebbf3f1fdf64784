"""nearswap: take the other model's value where it lies near the base (docs/SEMANTICS.md), elementwise."""

from __future__ import annotations

import numpy as np

from mergepipe_db.errors import MethodParameterError
from mergepipe_db.operators.gather import GatherFold, gather_kernels
from mergepipe_db.operators.registry import register

__all__ = ["Nearswap"]


@register("nearswap")
class Nearswap(GatherFold):
    """nearswap with parameter t: w = clamp(t / max(|θ₀ - θ_1|, 1e-6), 0, 1); out = w·θ_1 + (1 - w)·θ₀.
    An omitted block has θ_1 = θ₀ there (out = θ₀ up to the sign of a zero)."""

    gather = "theta"
    uses_theta = True
    raw_formula = True

    def _check(self) -> None:
        if self.n_experts != 1:
            raise MethodParameterError(f"nearswap merges exactly two models, the base and one other; got "
                                       f"{self.n_experts} others")
        if self.t is None:
            raise MethodParameterError("nearswap needs the parameter t")

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        """w = clip(t / maximum(|θ₀ − θ_1|, 1e-6), 0, 1); w·θ_1 + (1 − w)·θ₀, numpy's float32 operations in its
        order, one fused pass (`kernels.gather.nearswap`)."""
        assert self.t is not None
        a = np.ascontiguousarray(base).reshape(-1)
        b = np.ascontiguousarray(values[0]).reshape(-1)
        out = self.scratch("nearswap_out", a.shape[0])  # finish() may return a reused buffer
        gather_kernels().nearswap(out, a, b, np.float32(self.t))
        return out.reshape(base.shape)

    def _combine_raw(self, base: np.ndarray, raws: list[np.ndarray], read: np.ndarray) -> np.ndarray:
        """`_combine_all` with θ_1 widened from its stored values as the pass reads them
        (`kernels.gather.nearswap_raw`)."""
        assert self.t is not None
        a = np.ascontiguousarray(base).reshape(-1)
        out = self.scratch("nearswap_out", a.shape[0])
        gather_kernels().nearswap_raw(out, a, raws[0], read[0], np.float32(self.t))
        return out.reshape(base.shape)
