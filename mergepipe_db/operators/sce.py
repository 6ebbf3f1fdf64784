"""sce: select the elements of highest variance across the experts, weight each expert by its mean squared task
vector, erase the minority sign (docs/SEMANTICS.md). torch's var, topk and mean are the definition (their
summation orders set the bits); torch is imported when a tensor is finished."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mergepipe_db.operators.gather import GatherFold
from mergepipe_db.operators.registry import register

__all__ = ["Sce"]


@register("sce")
class Sce(GatherFold):
    """sce with parameter select_topk (default 1: no selection)."""

    option_defaults: ClassVar[dict[str, float]] = {"select_topk": 1.0}
    #: the variance, the sign election and the weights couple every expert's Δ of an element: block rows of all
    #: experts are read together
    joint_election: ClassVar[bool] = True
    uses_torch = True

    def coefficient(self, k: int) -> float:
        return 1.0

    def _combine_all(self, base: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
        import torch

        b = torch.from_numpy(base)
        tvs = torch.stack([torch.from_numpy(v) for v in values], dim=0)
        density = self.params["select_topk"]
        if density < 1:
            if density <= 0:
                mask = torch.zeros_like(tvs[0])
            else:
                var = torch.var(tvs, dim=0, unbiased=False)
                k = int(int(torch.count_nonzero(var)) * density)
                mask = torch.zeros_like(var)
                if k > 0:
                    _, idx = torch.topk(var.abs().view(-1), k=k, largest=True)
                    mask.view(-1)[idx] = 1
            tvs = tvs * mask.unsqueeze(0)
        sign = tvs.sign()
        majority = (tvs.sum(dim=0) >= 0).to(tvs.dtype) * 2 - 1
        erase = sign == majority
        weights = tvs.square().reshape(tvs.shape[0], -1).mean(dim=1)
        total = torch.sum(weights).item()
        if abs(total) < 1e-6:
            weights = torch.ones_like(weights) / weights.shape[0]
        else:
            weights = weights / total
        while weights.dim() < tvs.dim():
            weights = weights.unsqueeze(-1)
        erased = weights * erase
        merged = (tvs * erased).sum(dim=0)
        final = merged / torch.sum(erased, dim=0).clamp(min=1e-6)
        return (b + final).numpy()
