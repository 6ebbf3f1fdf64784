"""slerp: spherical interpolation between θ₀ and one other model, whole tensors at a time. torch's float64 norm
and dot are the definition (their summation order sets the bits); torch is imported when a tensor is finished."""

from __future__ import annotations

import math

import numpy as np

from mergepipe_db.errors import SpecError
from mergepipe_db.operators.base import MergeOperator
from mergepipe_db.operators.inputs import ExpertInput
from mergepipe_db.operators.registry import register

__all__ = ["Slerp"]


@register("slerp")
class Slerp(MergeOperator):
    """slerp between θ₀ and θ_1 with parameter t (whole tensors; an omitted tensor means θ_1 = θ₀)."""

    tensor_granular = True
    uses_theta = True
    uses_torch = True
    _theta1: np.ndarray | None = None

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

    def _begin(self) -> None:
        self._theta1 = None

    def _add(self, x: ExpertInput) -> None:
        self._theta1 = x.theta if x.selected_blocks else self._base

    def _finish(self) -> np.ndarray:
        import torch  # torch's float64 norm and dot are the definition (their summation order sets the bits)

        theta0, theta1, t = self._base, self._theta1, self.t
        assert theta0 is not None and theta1 is not None and t is not None
        n = theta0.size
        v0 = torch.from_numpy(self.scratch("v0d", n, np.float64))
        v0.copy_(torch.from_numpy(theta0.reshape(-1)))
        n0 = float(torch.linalg.vector_norm(v0))
        if theta1 is theta0:
            v1, n1 = v0, n0
        else:
            v1 = torch.from_numpy(self.scratch("v1d", n, np.float64))
            v1.copy_(torch.from_numpy(np.asarray(theta1, order="C").reshape(-1)))
            n1 = float(torch.linalg.vector_norm(v1))
        dot = float(torch.dot(v0, v1)) / ((n0 if n0 > 1e-8 else 1.0) * (n1 if n1 > 1e-8 else 1.0))
        if abs(dot) > 0.9995:
            c0, c1 = 1 - t, t
        else:
            th0 = math.acos(dot)
            s = math.sin(th0)
            tht = th0 * t
            c0, c1 = math.sin(th0 - tht) / s, math.sin(tht) / s
        out = np.multiply(theta0, c0, out=np.empty_like(theta0))  # out=: a 0-d result stays an array
        out += np.multiply(theta1, c1, out=self.scratch("D", n).reshape(theta0.shape))
        return out

    def _end(self) -> None:
        self._theta1 = None
