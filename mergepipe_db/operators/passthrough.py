"""passthrough: the tensor of the one source, copied (times `scale` when given): MergeKit's layer stacking.

The plan reads the source tensor as θ₀ (a slice's source is the "base" of its tensors); no expert is read, so a
copy costs no expert bytes and no arithmetic beyond the optional scale."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mergepipe_db.operators.base import ExpertParams, MergeOperator, finite
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.registry import register

__all__ = ["Passthrough"]


@register("passthrough")
class Passthrough(MergeOperator):
    """out = θ₀, or θ₀ * scale (a Python float). Other models of the merge (sources of other slices) are
    inputs of no tensor: their `add` contributes nothing and reads nothing."""

    def __init__(self, experts: Sequence[ExpertParams] = (), *, normalize: bool | None = None, lam: float = 1.0,
                 t: float | None = None, scale: float | None = None, options: Any = None) -> None:
        self.scale = None if scale is None else finite(scale, "scale", "passthrough")
        if experts:
            super().__init__(experts, normalize=normalize, lam=lam, t=t, options=options)
            return
        # no expert: the base state alone (MergeOperator requires one for the methods that merge)
        self.experts, self.weights, self.densities, self.gammas = (), [], [], []
        self.normalize, self.lam, self.t, self.weight_sum = False, 1.0, None, 1.0
        self._pool, self._base, self._bflat, self._ctx, self._next = {}, None, None, None, 0
        self._skip = self._table = None

    def coefficient(self, k: int) -> float:
        return 0.0  # nothing of an expert enters the result

    def _begin(self) -> None:
        return None

    def _add(self, x: ExpertInput) -> None:
        return None

    def _finish(self) -> np.ndarray:
        assert self._base is not None
        out = self.scratch("out", self._base.size).reshape(self._base.shape)
        if self.scale is None:
            np.copyto(out, self._base)
        else:
            np.multiply(self._base, np.float32(self.scale), out=out)
        return out

    def _base_only(self, b: np.ndarray) -> np.ndarray:
        return b.copy() if self.scale is None else b * np.float32(self.scale)
